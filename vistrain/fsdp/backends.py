"""How a model is distributed: the built-in engine, PyTorch's ``fully_shard`` behind the same
interface, or whole parameters (a plain module, DDP).

Code outside ``vistrain.fsdp`` (checkpoints, optimizer groups, the loop) asks here instead of
testing class names or private fields; identity comes from the engine's registry
(``ownership.py``), weak maps keyed by the objects:

    backend_of(model)      -> Backend.REPLICATED | Backend.BUILTIN | Backend.TORCH
    local_part(param)      -> which elements of which original parameter a local parameter holds
                              (its handle, origin, start, length), or None for a whole parameter
    shard_handle(param)    -> the FlatParamHandle behind a local parameter, or None
    unwrap(model)          -> the user's module inside DDP or the fully_shard adapter

:class:`TorchShardedModel` lets the same recipes run on ``fully_shard``
(``MODEL.FSDP_CONFIG.BACKEND=torch``) as a baseline to measure against; its parameters are
DTensor shards, named as those of ``self.module``.
"""

import enum
from dataclasses import dataclass
from typing import Optional

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from vistrain.fsdp.flat_param import FlatParamHandle, ParamOrigin
from vistrain.fsdp.fully_sharded import FullyShardedDataParallel
from vistrain.fsdp.ownership import local_param_of


class TorchShardedModel(nn.Module):
    """A module already sharded by ``fully_shard``, with DDP's/our engine's method names."""

    def __init__(self, module: nn.Module):
        super().__init__()
        self.module = module

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def no_sync(self):
        return _NoGradientSync(self.module)

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0):
        return torch.nn.utils.clip_grad_norm_(self.parameters(), max_norm, norm_type)

    def state_dict(self, *args, **kwargs):
        # imported here: torch.distributed.checkpoint takes seconds to import, and only this
        # backend needs it (every launcher and rank process imports this module)
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        return get_model_state_dict(self.module, options=StateDictOptions(full_state_dict=True))

    def load_state_dict(self, state_dict, strict: bool = True):
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        return set_model_state_dict(
            self.module, state_dict, options=StateDictOptions(full_state_dict=True, strict=strict)
        )


class _NoGradientSync:
    """``no_sync()`` for fully_shard: gradients stay unreduced until the block ends."""

    def __init__(self, module):
        self.module = module

    def __enter__(self):
        self.module.set_requires_gradient_sync(False)

    def __exit__(self, *exc):
        self.module.set_requires_gradient_sync(True)


class Backend(enum.Enum):
    """How a model's parameters live on the ranks."""

    REPLICATED = "replicated"  # a plain module or DDP: every rank holds whole parameters
    BUILTIN = "builtin"  # vistrain.fsdp.FullyShardedDataParallel: views of flat padded shards
    TORCH = "torch"  # torch's fully_shard through TorchShardedModel: DTensor shards


def backend_of(model: nn.Module) -> Backend:
    if isinstance(model, FullyShardedDataParallel):
        return Backend.BUILTIN
    if isinstance(model, TorchShardedModel):
        return Backend.TORCH
    return Backend.REPLICATED


@dataclass(frozen=True)
class LocalPart:
    """What a local parameter of the built-in engine holds: elements ``[start, start + length)``
    of the flattened original parameter ``origin`` of ``handle`` (length 0: none on this rank)."""

    handle: FlatParamHandle
    origin: ParamOrigin
    start: int
    length: int


def local_part(param: nn.Parameter) -> Optional[LocalPart]:
    """The part of an original parameter that ``param`` is on this rank, if it is a local
    parameter of the built-in engine; None for a whole parameter."""
    found = local_param_of(param)
    if found is None:
        return None
    handle, index = found
    for i, _, start, length in handle.local_slices():
        if i == index:
            return LocalPart(handle, handle.origins[index], start, length)
    return LocalPart(handle, handle.origins[index], 0, 0)


def shard_handle(param: nn.Parameter) -> Optional[FlatParamHandle]:
    """The handle behind a local parameter of the built-in engine, else None."""
    found = local_param_of(param)
    return None if found is None else found[0]


def unwrap(model: nn.Module) -> nn.Module:
    """The user's module inside DDP or the fully_shard adapter (names without "module.");
    the built-in engine and plain modules are returned as they are."""
    if isinstance(model, (DistributedDataParallel, nn.DataParallel, TorchShardedModel)):
        return model.module
    return model
