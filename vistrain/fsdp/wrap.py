"""Wrap policies: which submodules become their own sharded unit, with which options."""

import contextlib
from typing import Callable, Dict, Iterable, Optional, Type, Union

from torch import nn

from vistrain.fsdp.fully_sharded import FullyShardedDataParallel
from vistrain.fsdp.model_state import RootOptions
from vistrain.fsdp.ownership import check_untied_leftovers, mark_tied_params, module_references, owner_of

# A policy maps a module to None (not a unit of its own) or to per-unit option overrides.
Policy = Callable[[nn.Module], Optional[dict]]


def by_class(classes: Union[Iterable[Type[nn.Module]], Dict[Type[nn.Module], dict]]) -> Policy:
    """Policy wrapping every instance of the given classes; a dict gives per-class overrides.

    Example: ``by_class({ResBottleneckBlock: {}, nn.BatchNorm2d: {"precision": KEEP_FP32}})``.
    """
    table = dict(classes) if isinstance(classes, dict) else {c: {} for c in classes}

    def policy(module: nn.Module) -> Optional[dict]:
        for cls, overrides in table.items():
            if isinstance(module, cls):
                return overrides
        return None

    return policy


def by_size(min_num_params: int) -> Policy:
    """Policy wrapping every module holding at least ``min_num_params`` parameters (recursively)."""

    def policy(module: nn.Module) -> Optional[dict]:
        return {} if sum(p.numel() for p in module.parameters()) >= min_num_params else None

    return policy


def auto_wrap(
    module: nn.Module,
    policy: Policy,
    wrap_root: bool = True,
    root: Optional[RootOptions] = None,
    **unit_kwargs,
) -> nn.Module:
    """Wrap, children first, every submodule the policy selects, then the root.

    ``unit_kwargs`` (``FullyShardedDataParallel``'s per-unit arguments) are the defaults of every
    unit; the policy's overrides win per unit. ``root``: the whole model's options, given to the
    root. Returns the root ``FullyShardedDataParallel`` (or the module itself when not
    ``wrap_root``). Tied parameters go to the lowest unit that owns all their users; a submodule
    reachable under several names becomes one unit referenced under all of them.
    """
    mark_tied_params(module)
    _wrap_children(module, policy, unit_kwargs, module_references(module))
    if not wrap_root:
        check_untied_leftovers(module)
        return module
    return FullyShardedDataParallel(module, **unit_kwargs, root=root)


def _wrap_children(module: nn.Module, policy: Policy, defaults: dict, refs, prefix: str = "") -> None:
    for name, child in list(module.named_children()):
        if isinstance(child, FullyShardedDataParallel):
            continue  # already wrapped (also: a shared submodule met under its second name)
        _wrap_children(child, policy, defaults, refs, f"{prefix}{name}.")
        overrides = policy(child)
        if overrides is not None:
            kwargs = {**defaults, **overrides}
            if kwargs.get("param_group_fn") is not None:
                kwargs["param_group_fn"] = _from_root(kwargs["param_group_fn"], f"{prefix}{name}.")
            unit = FullyShardedDataParallel(child, **kwargs)
            for parent, child_name in refs.get(id(child), [(module, name)]):
                setattr(parent, child_name, unit)


def _from_root(group_fn: Callable, prefix: str) -> Callable:
    """A unit sees names relative to itself; grouping rules (e.g. "head.") need root names."""

    def grouped(fqn, module, param):
        return group_fn(prefix + fqn, module, param)

    return grouped


def params_of(module: nn.Module):
    """The parameters holding ``module``'s weights: its own, sharded or not (under the engine,
    this rank's part of each original parameter, registered on ``module`` as before wrapping)."""
    return list(module.parameters())


def gathered(module: nn.Module, writeback: bool = True):
    """Context in which ``module``'s full weights are present and writable (collective if sharded)."""
    owner = owner_of(module)
    if owner is None:
        return contextlib.nullcontext()
    return owner.summon_full_params(recurse=True, writeback=writeback)
