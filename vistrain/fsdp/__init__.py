"""vistrain's built-in fully sharded data parallel engine (FairScale-compatible names).

from vistrain.fsdp import FullyShardedDataParallel as FSDP, auto_wrap, by_class
model = auto_wrap(model, by_class({Block: {}}), mixed_precision=True)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)   # holds only this rank's shards
"""

import vistrain.fsdp.state_dict  # noqa: F401  (methods import it lazily; load it eagerly)
from vistrain.fsdp.fully_sharded import FullyShardedDataParallel  # noqa: F401
from vistrain.fsdp.grad import origin_sq_norms  # noqa: F401
from vistrain.fsdp.mixed_precision import ShardedGradScaler  # noqa: F401
from vistrain.fsdp.wrap import auto_wrap, by_class, by_size, gathered, params_of  # noqa: F401
