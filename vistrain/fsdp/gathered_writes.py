"""In-place writes into the weights a unit gathered for one of its public methods
(``gather_public_methods``): they land in the shards at once, as DDP's land in its parameters, or
the call stops on one line.

While a unit is gathered its modules' attributes are views of one temporary flat tensor
(``flat_param.py``), freed after the call. A method such as lightly's ``SwaVPrototypes.normalize()``
(``weight.div_(norm)`` under ``no_grad``), ``weight.data.mul_(2)`` or ``weight.data = t`` writes
into those views. :class:`WriteGuard` watches the call's torch operations: a write into the
gathered flat tensor runs on its ``.data`` (so what autograd saved of the unit's other weights
stays valid, as under DDP, where they are separate tensors), then this rank's part of the flat
tensor goes into the shard (every rank ran the same write, so every shard gets its part). Code
after the write, in the same call or a later one, computes on the written values. A write under
grad mode into a weight that needs a gradient is left to autograd, which refuses it as it refuses
DDP's.

Under mixed precision the gathered weights are low-precision copies: writing them back would round
every fp32 shard, so the write raises :class:`GatheredWriteError` instead, naming the method and
the fixes. A method that only reads runs unchanged; the guard costs one Python call per torch
operation of the method (``docs/engine.md`` gives the measured cost).
"""

from typing import Optional, Sequence, Tuple

import torch
from torch.overrides import TorchFunctionMode

from vistrain.fsdp.flat_param import FlatParamHandle
from vistrain.torch_compat import tree_map

# in-place by name (trailing "_") but writing no values
_METADATA_ONLY = frozenset({"requires_grad_", "share_memory_", "detach_"})
_DATA = torch.Tensor.data  # the descriptor of ``tensor.data``: its ``__set__`` swaps the storage


class GatheredWriteError(RuntimeError):
    """A method gathered by ``gather_public_methods`` wrote into low-precision gathered weights."""


def written_tensors(func, args: tuple, kwargs: dict) -> Sequence:
    """The tensors ``func(*args, **kwargs)`` writes in place (empty for a pure function):
    ``x.mul_()``, ``torch._foreach_mul_([...])``, ``nn.init.normal_(x)``, ``x[i] = v``,
    ``F.relu(x, inplace=True)``, ``out=x``, ``x.data = t``."""
    name = getattr(func, "__name__", "")
    if name.endswith("_") and not name.endswith("__") and name not in _METADATA_ONLY:
        target = args[0] if args else next(iter(kwargs.values()), None)
    elif name == "__setitem__" or kwargs.get("inplace") is True:
        target = args[0] if args else None
    elif name == "__set__" and getattr(func, "__self__", None) is _DATA:
        target = args[0]
    elif kwargs.get("out") is not None:
        target = kwargs["out"]
    else:
        return ()
    return target if isinstance(target, (list, tuple)) else (target,)


class WriteGuard(TorchFunctionMode):
    """Watches one gathered call of a unit for in-place writes into its gathered weights.

    Args:
        handles: the unit's flat parameters, gathered (their ``full`` tensors are watched).
        what: ``"Class.method"``, for the message.
    """

    def __init__(self, handles: Sequence[FlatParamHandle], what: str):
        super().__init__()
        self.what = what
        # the storage address of each gathered flat tensor: stable while the call runs
        self.by_storage = {
            h.full.untyped_storage().data_ptr(): h for h in handles if h.full.untyped_storage().nbytes()
        }

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        hit = self._gathered_target(written_tensors(func, args, kwargs))
        if hit is None:
            return func(*args, **kwargs)
        handle, tensor = hit
        if handle.compute_dtype != handle.param_dtype:
            why = (
                f"gathered in {handle.compute_dtype} (mixed precision: writing it back would round "
                f"the {handle.param_dtype} shards)"
            )
            raise GatheredWriteError(self._message(handle, tensor, func, why))
        if getattr(func, "__self__", None) is _DATA:  # ``w.data = t``: t's values into the weights
            value = args[1]
            if not isinstance(value, torch.Tensor) or value.shape != tensor.shape:
                why = f"with another shape ({list(getattr(value, 'shape', []))}): a sharded weight keeps its shape"
                raise GatheredWriteError(self._message(handle, tensor, func, why))
            tensor.data.copy_(value)
            out = None
        else:
            if not (torch.is_grad_enabled() and tensor.requires_grad):  # autograd records nothing
                args, kwargs = tree_map(self._unseen_by_autograd, (args, kwargs))
            out = func(*args, **kwargs)
        handle.write_back(handle.full.detach())  # every rank wrote the same: this rank's part
        return out

    def _unseen_by_autograd(self, value):
        """A gathered weight's ``.data``: a write to it leaves the flat tensor's version counter,
        shared by every weight of the unit, alone. (Under DDP the weights are separate tensors:
        writing one under ``no_grad`` leaves what autograd saved of the others valid.)"""
        return value.data if self._watched(value) else value

    def _watched(self, value) -> bool:
        """``value`` is a tensor in one of the unit's gathered flat tensors."""
        return (
            isinstance(value, torch.Tensor)
            and value.layout == torch.strided
            and value.untyped_storage().data_ptr() in self.by_storage
        )

    def _gathered_target(self, tensors) -> Optional[Tuple[FlatParamHandle, torch.Tensor]]:
        for tensor in tensors:
            if self._watched(tensor):
                return self.by_storage[tensor.untyped_storage().data_ptr()], tensor
        return None

    def _message(self, handle: FlatParamHandle, tensor: torch.Tensor, func, why: str) -> str:
        method = self.what.split(".")[-1]
        name = getattr(func, "__name__", str(func))
        return (
            f"{self.what}() wrote in place ({name}) into the weight {_param_name(handle, tensor)}, "
            f"which gather_public_methods gathered for the call, {why}; write the local parameters "
            "outside the gathered call (module.parameters() hold this rank's rows), or keep the method "
            f'on the shards: vistrain.fsdp.keep_on_shards(module, "{method}")'
        )


def _param_name(handle: FlatParamHandle, tensor: torch.Tensor) -> str:
    """The original parameter whose part of the flat tensor ``tensor`` starts in."""
    offset = tensor.storage_offset()
    for origin in handle.origins:
        if origin.flat_offset <= offset < origin.flat_offset + origin.numel:
            return origin.fqn or origin.local_fqn
    return handle.describe()
