"""vistrain's built-in fully sharded data parallel engine.

from vistrain.fsdp import FullyShardedDataParallel as FSDP, Precision, auto_wrap, by_class
model = auto_wrap(model, by_class({Block: {}}), precision=Precision(torch.bfloat16, torch.float32))
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)   # holds only this rank's shards

The engine's parts: ``fully_sharded`` (the ``nn.Module`` shell), ``unit`` (one unit's state and
phases), ``model_state`` (what a model's units share; :class:`RootOptions`), ``unit_order`` (the
execution order and its first-step check), ``flat_param`` (flat padded shards), ``shard_grad``
(what a shard's gradient carries: no_sync micro-batches, parameters without gradient),
``reductions`` (gradient reductions in flight), ``collectives`` (:class:`ShardGroups`, hybrid
groups, waits),
``precision``, ``ownership`` (which unit owns what; the registry), ``wrap`` (policies),
``state_dict``, ``grads`` (clipping, LARS norms, the step in backward), ``deferred_init``
(meta-device builds), ``forward_methods`` (methods other than ``forward`` that gather), ``gathered_writes`` (the
write check of methods gathered without registration), ``ema`` (a momentum teacher's update of local shards), ``memory`` (storage bytes, RSS), ``backends`` (how a model is distributed).
"""

from vistrain.fsdp.backends import (  # noqa: F401
    Backend,
    LocalPart,
    TorchShardedModel,
    backend_of,
    local_part,
    shard_handle,
    unwrap,
)
from vistrain.fsdp.collectives import (  # noqa: F401
    CollectiveError,
    CollectiveTimeout,
    ShardGroups,
    hybrid_groups,
    replica_group_ranks,
    shard_group_ranks,
)
from vistrain.fsdp.deferred_init import build_on_meta, materialize  # noqa: F401
from vistrain.fsdp.ema import LayoutMismatchError, ema_update_, foreach_ema_, paired_tensors  # noqa: F401
from vistrain.fsdp.forward_methods import (  # noqa: F401
    UnregisteredMethodError,
    keep_on_shards,
    register_forward_method,
)
from vistrain.fsdp.fully_sharded import FullyShardedDataParallel  # noqa: F401
from vistrain.fsdp.gathered_writes import GatheredWriteError  # noqa: F401
from vistrain.fsdp.grads import (  # noqa: F401
    OptimizerInBackward,
    PartialStepError,
    SegmentValues,
    apply_optimizer_in_backward,
    origin_sq_norms,
    origin_sq_sums,
)
from vistrain.fsdp.model_state import RootOptions  # noqa: F401
from vistrain.fsdp.precision import FULL_PRECISION, KEEP_FP32, Precision, ShardedGradScaler  # noqa: F401
from vistrain.fsdp.wrap import auto_wrap, by_class, by_size, gathered, params_of  # noqa: F401
