"""Which parameters and modules a unit owns, where it computes, and checks against misuse."""

import torch
import torch.distributed as dist
from torch import nn

from vistrain.fsdp import registry
from vistrain.fsdp.names import clean_name
from vistrain.torch_compat import own_parameters


def is_unit(module: nn.Module) -> bool:
    """A FullyShardedDataParallel instance (marked by the class, to avoid a circular import)."""
    return getattr(module, "is_sharded_unit", False)


def owned_modules(module: nn.Module):
    """``module`` and its submodules, not descending into nested units."""
    return (sub for sub, _ in _owned_with_prefix(module, ""))


def owned_params(module: nn.Module, prefix: str = ""):
    """(fqn, module, attr, param, aliases) of the parameters this unit shards.

    Those of modules not inside nested units, except tied parameters whose scope (the lowest
    module using them all, registered by ``sharing.mark_tied_params``) lies outside ``module``; plus
    tied parameters whose scope this unit owns, wherever they appear. ``aliases`` lists the
    further (module, attr) places of a tied parameter.
    """
    owned = {id(sub) for sub in owned_modules(module)}
    found = {}  # id(param) -> [fqn, module, attr, param, aliases]
    for sub, sub_prefix in _owned_with_prefix(module, prefix):
        _check_not_wrapped_elsewhere(sub, sub_prefix, module)
        for attr, param in own_parameters(sub).items():
            if param is not None and _in_scope(param, owned):
                _add_place(found, f"{sub_prefix}{attr}", sub, attr, param)
    for path, sub in module.named_modules(prefix=prefix.rstrip("."), remove_duplicate=False):
        if id(sub) in owned:
            continue
        for attr, param in own_parameters(sub).items():  # tied ones left here by nested units
            if param is not None and registry.tie_of(param) is not None and _in_scope(param, owned):
                _add_place(found, clean_name(f"{path}.{attr}"), sub, attr, param)
    return [tuple(entry) for entry in found.values()]


def _in_scope(param, owned) -> bool:
    tie = registry.tie_of(param)
    return tie is None or id(tie[0]) in owned


def _add_place(found, fqn, sub, attr, param) -> None:
    replaced = registry.replaced_by(param)
    if replaced is not None:
        unit, local = replaced
        raise ValueError(
            f"parameter {fqn} is tied to {local} of an already wrapped unit ({type(unit.module).__name__}); "
            "a tied parameter must live in the lowest unit owning all its users: wrap with "
            "auto_wrap, or wrap a module that contains every user"
        )
    entry = found.get(id(param))
    if entry is None:
        found[id(param)] = [fqn, sub, attr, param, []]
    elif (sub, attr) != (entry[1], entry[2]) and (sub, attr) not in entry[4]:
        entry[4].append((sub, attr))


def _check_not_wrapped_elsewhere(sub: nn.Module, path: str, module: nn.Module) -> None:
    if registry.owner_of(sub) is not None:
        raise ValueError(
            f"module {path.rstrip('.') or '<root>'} ({type(sub).__name__}) is already inside a "
            "sharded unit under another name; refer to that unit under both names (auto_wrap "
            "does this)"
        )


def _owned_with_prefix(module, prefix):
    yield module, prefix
    for name, child in module.named_children():
        if not is_unit(child):
            yield from _owned_with_prefix(child, f"{prefix}{name}.")


def compute_device(module: nn.Module, move_params_to_cpu: bool) -> torch.device:
    if move_params_to_cpu or _on_meta(module):  # meta: built for per-unit initialisation
        return (
            torch.device("cuda", torch.cuda.current_device())
            if torch.cuda.is_available()
            else torch.device("cpu")
        )
    for tensor in list(module.parameters()) + list(module.buffers()):
        return tensor.device
    return torch.device("cpu")


def _on_meta(module: nn.Module) -> bool:
    return any(t.is_meta for t in list(module.parameters()) + list(module.buffers()))


def check_wrappable(module: nn.Module) -> None:
    if is_unit(module):
        raise ValueError("module is already wrapped by FullyShardedDataParallel (wrapping twice)")
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(
            "FullyShardedDataParallel needs an initialised process group: call "
            "torch.distributed.init_process_group (or launch with tools/run_distributed.py) first"
        )
