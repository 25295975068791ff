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

Or, with the unit option ``gather_public_methods=True`` (``auto_wrap(..., gather_public_methods=True)``
for every unit; the Lightning strategy's default), without a line: each public method the wrapped
module's own class defines (:func:`gathers_by_itself`: ``encode``, ``forward_features``,
``forward_head``..., not ``nn.Module``'s nor torch's layers') gathers as a registered one does,
watched by ``gathered_writes.WriteGuard``: an in-place write into the gathered weights lands in
the shards at once (under mixed precision it is an error).
``keep_on_shards(module, "normalize")`` keeps one method out of it.

A call made while the same unit's forward or gathered method runs (``unit.forward`` from its own
``encode`` through a reference to the unit) finds the weights gathered and runs plainly: one
gather, freed when the outer call ends.

Any other method reached through the wrapper runs as it is, under :class:`ShardGuard`: code that
keeps to the shards (an EMA, normalising prototype rows in place: rows are whole on every rank)
works as before, and the first operation that mixes a shard with any other tensor (an
activation, an input) raises :class:`UnregisteredMethodError`, naming the line to add, instead
of a shape error deep inside the method (or, on the rank holding a whole parameter, a silent
partial result).
"""

import inspect
from typing import Callable, Iterable, Sequence

import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten
from torch.utils.weak import WeakIdKeyDictionary

from vistrain.fsdp.ownership import (
    forward_methods_of,
    local_param_of,
    set_forward_methods,
    set_shard_methods,
    shard_methods_of,
)
from vistrain.fsdp.precision import iter_tensors


class UnregisteredMethodError(RuntimeError):
    """A method reached through a sharded unit computed with this rank's shards."""


def register_forward_method(module: nn.Module, *names: str) -> None:
    """Gather ``module``'s weights around each of ``names`` as around its ``forward``.

    ``module``: a plain module (registered before it becomes a unit) or a unit. Each name must
    be a method of the module; ``forward`` needs no registration."""
    target = _wrapped(module)
    for name in names:
        if name == "forward":
            raise ValueError("forward gathers without registration: register other methods only")
        if not callable(getattr(target, name, None)):
            raise ValueError(
                f"register_forward_method: {type(target).__name__} has no method {name!r} to gather around"
            )
    set_forward_methods(target, set(forward_methods_of(target)) | set(names))


def keep_on_shards(module: nn.Module, *names: str) -> None:
    """Never gather ``module``'s weights around ``names``, even with ``gather_public_methods``:
    they run on this rank's shards, under :class:`ShardGuard` (a method that normalises
    prototype rows in place under mixed precision; one that runs on some ranks only)."""
    target = _wrapped(module)
    registered = sorted(set(names) & forward_methods_of(target))
    if registered:
        raise ValueError(
            f"keep_on_shards: {registered[0]!r} is registered as a forward method of {type(target).__name__}"
        )
    for name in names:
        if not callable(getattr(target, name, None)):
            raise ValueError(f"keep_on_shards: {type(target).__name__} has no method {name!r}")
    set_shard_methods(target, set(shard_methods_of(target)) | set(names))


def _wrapped(module: nn.Module) -> nn.Module:
    return getattr(module, "module", module) if getattr(module, "is_sharded_unit", False) else module


def gathers_by_itself(module: nn.Module, name: str) -> bool:
    """Whether ``gather_public_methods`` gathers around ``module.name``: a public plain function
    (no ``_`` prefix, no property, static or class method) that ``module``'s class or a base
    class before ``nn.Module`` in its MRO defines, that class not one of torch's own; no name
    ``nn.Module`` has (``state_dict``, ``apply``, ``train``...); not kept by :func:`keep_on_shards`.

    The method is the first one Python finds: ``type(module).__mro__`` up to ``nn.Module``."""
    if name.startswith("_") or hasattr(nn.Module, name) or name in shard_methods_of(module):
        return False
    for cls in type(module).__mro__:
        if cls is nn.Module:
            return False
        if name in vars(cls):
            return inspect.isfunction(vars(cls)[name]) and cls.__module__.split(".")[0] != "torch"
    return False


def gathered_call(unit, name: str, method: Callable, watch_writes: bool = False) -> Callable:
    """``method`` (a bound method of ``unit.module``) run inside the unit's forward phases;
    ``watch_writes``: under ``WriteGuard`` while the weights are gathered."""
    watched = f"{type(unit.module).__name__}.{name}" if watch_writes else None

    def call(*args, **kwargs):
        return unit.run_as_forward(method, args, kwargs, watched)

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
        f'(or give the wrap policy the unit option forward_methods=("{method}",), or wrap with '
        f"gather_public_methods=True)"
    )
