"""Methods other than ``forward`` that gather a unit's weights (FSDP2's
``register_fsdp_forward_method``), and the guard on the methods that do not.

Masked-image models call their encoder by name (``backbone.encode(images, idx_keep)``,
``decoder.decode(tokens)``). On a unit, ``unit.encode`` reaches the wrapped module's method
through the wrapper, outside its ``forward``: without help it would compute with this rank's
shards. A method *registered* as a forward method runs exactly as the unit's forward does::

    begin_forward (gather, prefetch)  ->  module.encode(*args)  ->  end_forward (free, hook outputs)

Three ways to register, any before or after wrapping:

    register_forward_method(backbone, "encode")                     # one line, by the user
    by_class({MaskedViT: {"forward_methods": ("encode",)}})         # the wrap policy
    FullyShardedDataParallel(backbone, forward_methods=("encode",))  # a unit's option

Any other method reached through the wrapper runs as it is, under :class:`ShardGuard`: code that
keeps to the shards (an EMA, normalising prototype rows in place: rows are whole on every rank)
works as before, and the first operation that mixes a shard with any other tensor (an
activation, an input) raises :class:`UnregisteredMethodError`, naming the line to add, instead
of a shape error deep inside the method (or, on the rank holding a whole parameter, a silent
partial result).
"""

from typing import Callable, Iterable, Sequence

import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten
from torch.utils.weak import WeakIdKeyDictionary

from vistrain.fsdp.ownership import forward_methods_of, local_param_of, set_forward_methods
from vistrain.fsdp.precision import iter_tensors


class UnregisteredMethodError(RuntimeError):
    """A method reached through a sharded unit computed with this rank's shards."""


def register_forward_method(module: nn.Module, *names: str) -> None:
    """Gather ``module``'s weights around each of ``names`` as around its ``forward``.

    ``module``: a plain module (registered before it becomes a unit) or a unit. Each name must
    be a method of the module; ``forward`` needs no registration."""
    target = getattr(module, "module", module) if getattr(module, "is_sharded_unit", False) else module
    for name in names:
        if name == "forward":
            raise ValueError("forward gathers without registration: register other methods only")
        if not callable(getattr(target, name, None)):
            raise ValueError(
                f"register_forward_method: {type(target).__name__} has no method {name!r} to gather around"
            )
    set_forward_methods(target, set(forward_methods_of(target)) | set(names))


def gathered_call(unit, name: str, method: Callable) -> Callable:
    """``method`` (a bound method of ``unit.module``) run inside the unit's forward phases."""

    def call(*args, **kwargs):
        return unit.run_as_forward(method, args, kwargs)

    call.__name__ = call.__qualname__ = name
    call.__doc__ = method.__doc__
    return call


def guarded_call(unit, name: str, method: Callable) -> Callable:
    """``method`` run as it is, raising :class:`UnregisteredMethodError` if it mixes a shard of
    ``unit`` (or of a unit inside it) with another tensor."""

    def call(*args, **kwargs):
        with ShardGuard(_local_params(unit), f"{type(unit.module).__name__}.{name}"):
            return method(*args, **kwargs)

    call.__name__ = call.__qualname__ = name
    call.__doc__ = method.__doc__
    return call


def _local_params(unit) -> Iterable[torch.Tensor]:
    return [
        param for sub in unit.units() for handle in sub.unit_state.handles for param in handle.local_params
    ]


class ShardGuard(TorchFunctionMode):
    """Watches the torch operations of one call. Shards and every result computed only from
    shards are *shard-derived*; an operation with a shard-derived input and another tensor of
    more than one element raises :class:`UnregisteredMethodError`.

    Args:
        shards: this rank's local parameters of the unit and its nested units.
        what: ``"Class.method"``, for the message.
    """

    def __init__(self, shards: Sequence[torch.Tensor], what: str):
        super().__init__()
        self.derived = WeakIdKeyDictionary()  # by identity: a tensor's == is elementwise
        for tensor in shards:
            self.derived[tensor] = True
        self.what = what

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        tensors = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        derived = [t for t in tensors if t in self.derived]
        if derived and any(t not in self.derived and t.numel() > 1 for t in tensors):
            raise UnregisteredMethodError(_message(self.what, derived[0]))
        out = func(*args, **kwargs)
        if derived:
            for tensor in iter_tensors(out):
                self.derived[tensor] = True
        return out


def _message(what: str, tensor: torch.Tensor) -> str:
    method = what.split(".")[-1]
    found = local_param_of(tensor)
    if found is not None:
        handle, index = found
        origin = handle.origins[index]
        shard = f" of {origin.fqn or origin.local_fqn} ({list(tensor.shape)} of {list(origin.shape)})"
    else:
        shard = ""
    return (
        f"{what}() computed with this rank's shard{shard}: a sharded unit gathers its weights for "
        f"forward and for its registered forward methods only; register it in one line, "
        f'vistrain.fsdp.register_forward_method(module, "{method}"), before the first step '
        f'(or give the wrap policy the unit option forward_methods=("{method}",))'
    )
