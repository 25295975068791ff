"""The engine's one registry: what the engine knows about objects it does not own.

A parameter replaced by a flat shard, the handle behind a shard, the unit owning a module, the
scope of a tied parameter: each is an entry in a weak map keyed by the object (by identity: a
tensor's ``==`` is elementwise), never an attribute pinned on it. Entries die with their keys;
values are weak references, so the registry keeps nothing alive.

The optimizer check lives here too: torch offers only a process-wide step pre-hook to see an
optimizer the engine did not build, so it is installed once, and each optimizer is scanned on
its first step and again only when its parameter lists change size.
"""

import weakref
from typing import List, Optional, Tuple

from torch import nn
from torch.optim.optimizer import register_optimizer_step_pre_hook
from torch.utils.weak import WeakIdKeyDictionary


class _Registry:
    def __init__(self):
        self.handle_of_shard = WeakIdKeyDictionary()  # shard -> weakref(FlatParamHandle)
        self.replaced = WeakIdKeyDictionary()  # original param -> (weakref(unit), local fqn)
        self.owner_of_module = WeakIdKeyDictionary()  # module -> weakref(unit owning it)
        self.tie_of_param = WeakIdKeyDictionary()  # tied param -> (weakref(scope module), names)
        self.checked_optimizers = WeakIdKeyDictionary()  # optimizer -> param counts when checked
        self.optimizer_hook = None


_REGISTRY = _Registry()


def register_shard(shard: nn.Parameter, handle) -> None:
    _REGISTRY.handle_of_shard[shard] = weakref.ref(handle)


def handle_of(param):
    """The FlatParamHandle whose shard ``param`` is, or None."""
    ref = _REGISTRY.handle_of_shard.get(param)
    return ref() if ref is not None else None


def mark_replaced(param: nn.Parameter, unit, local_fqn: str) -> None:
    """``param`` now lives in a flat shard of ``unit``: an optimizer holding it must fail."""
    _REGISTRY.replaced[param] = (weakref.ref(unit), local_fqn)
    _install_optimizer_check()


def replaced_by(param) -> Optional[Tuple[object, str]]:
    """(unit, local fqn) of the unit that replaced ``param`` by a shard, or None."""
    entry = _REGISTRY.replaced.get(param)
    return None if entry is None else (entry[0](), entry[1])


def set_owner(module: nn.Module, unit) -> None:
    _REGISTRY.owner_of_module[module] = weakref.ref(unit)


def owner_of(module: nn.Module):
    """The sharded unit owning ``module`` (it is inside that unit, not a nested one), or None."""
    ref = _REGISTRY.owner_of_module.get(module)
    return ref() if ref is not None else None


def mark_tied(param: nn.Parameter, scope: nn.Module, names: List[str]) -> None:
    """``param`` is used at ``names``; ``scope`` is the lowest module containing them all."""
    _REGISTRY.tie_of_param[param] = (weakref.ref(scope), names)


def tie_of(param) -> Optional[Tuple[nn.Module, List[str]]]:
    """(scope module, names) of a tied parameter, or None for an untied one."""
    entry = _REGISTRY.tie_of_param.get(param)
    return None if entry is None else (entry[0](), entry[1])


def _install_optimizer_check() -> None:
    if _REGISTRY.optimizer_hook is None:
        _REGISTRY.optimizer_hook = register_optimizer_step_pre_hook(_check_optimizer)


def _check_optimizer(optimizer, args, kwargs) -> None:
    """Refuse a step of an optimizer built on parameters the engine replaced by shards."""
    counts = tuple(len(group["params"]) for group in optimizer.param_groups)
    if _REGISTRY.checked_optimizers.get(optimizer) == counts:
        return
    for group in optimizer.param_groups:
        for param in group["params"]:
            if param in _REGISTRY.replaced:
                raise RuntimeError(
                    "the optimizer holds parameters that FullyShardedDataParallel replaced by "
                    "shards: build the optimizer on model.parameters() after wrapping"
                )
    _REGISTRY.checked_optimizers[optimizer] = counts
