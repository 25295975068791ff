"""One typed way to ask how a model is distributed and what a flat shard holds.

Code outside ``vistrain.fsdp`` (checkpoints, optimizer groups, the loop) asks here instead of
testing class names or private fields; identity comes from the engine's one registry
(``registry.py``), weak maps keyed by the objects:

    backend_of(model)      -> Backend.REPLICATED | Backend.BUILTIN | Backend.TORCH
    shard_handle(param)    -> the FlatParamHandle of a flat shard, or None for a whole parameter
    shard_origins(param)   -> the original parameters a flat shard holds (fqn, module, shape), or None
    unwrap(model)          -> the user's module inside DDP or the fully_shard adapter
"""

import enum
from typing import Optional, Sequence

from torch import nn
from torch.nn.parallel import DistributedDataParallel

from vistrain.fsdp import registry
from vistrain.fsdp.flat_param import FlatParamHandle, ParamOrigin
from vistrain.fsdp.fully_sharded import FullyShardedDataParallel
from vistrain.fsdp.torch_backend import TorchShardedModel


class Backend(enum.Enum):
    """How a model's parameters live on the ranks."""

    REPLICATED = "replicated"  # a plain module or DDP: every rank holds whole parameters
    BUILTIN = "builtin"  # vistrain.fsdp.FullyShardedDataParallel: flat padded shards
    TORCH = "torch"  # torch's fully_shard through TorchShardedModel: DTensor shards


def backend_of(model: nn.Module) -> Backend:
    if isinstance(model, FullyShardedDataParallel):
        return Backend.BUILTIN
    if isinstance(model, TorchShardedModel):
        return Backend.TORCH
    return Backend.REPLICATED


def shard_handle(param: nn.Parameter) -> Optional[FlatParamHandle]:
    """The handle that owns ``param`` if it is a flat shard of the built-in engine, else None."""
    return registry.handle_of(param)


def shard_origins(param: nn.Parameter) -> Optional[Sequence[ParamOrigin]]:
    """The original parameters a flat shard holds, in flattening order; None for a whole parameter."""
    handle = shard_handle(param)
    return None if handle is None else handle.origins


def unwrap(model: nn.Module) -> nn.Module:
    """The user's module inside DDP or the fully_shard adapter (names without "module.");
    the built-in engine and plain modules are returned as they are."""
    if isinstance(model, (DistributedDataParallel, nn.DataParallel, TorchShardedModel)):
        return model.module
    return model
