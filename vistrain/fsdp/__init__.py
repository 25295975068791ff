"""vistrain's built-in fully sharded data parallel engine (FairScale-compatible names).

from vistrain.fsdp import FullyShardedDataParallel as FSDP, auto_wrap, by_class
model = auto_wrap(model, by_class({Block: {}}), mixed_precision=True)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)   # holds only this rank's shards
"""

from vistrain.fsdp.deferred_init import build_on_meta, materialize  # noqa: F401
from vistrain.fsdp.fully_sharded import FullyShardedDataParallel  # noqa: F401
from vistrain.fsdp.grad import SegmentValues, origin_sq_norms, origin_sq_sums  # noqa: F401
from vistrain.fsdp.hybrid import hybrid_groups, replica_group_ranks, shard_group_ranks  # noqa: F401
from vistrain.fsdp.mixed_precision import ShardedGradScaler  # noqa: F401
from vistrain.fsdp.optim_in_backward import OptimizerInBackward, apply_optimizer_in_backward  # noqa: F401
from vistrain.fsdp.query import Backend, backend_of, shard_handle, shard_origins, unwrap  # noqa: F401
from vistrain.fsdp.torch_backend import TorchShardedModel  # noqa: F401
from vistrain.fsdp.wrap import auto_wrap, by_class, by_size, gathered, params_of  # noqa: F401
