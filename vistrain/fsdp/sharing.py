"""Wrap-time handling of sharing: tied parameters and one submodule under several names.

A parameter tied across modules (encoder/decoder weight sharing) must live in exactly one flat
parameter, in the lowest unit that owns every module using it, or the tie is silently lost.
``auto_wrap`` marks each tied parameter with the lowest common ancestor of its users (its
*scope*); a unit skips tied parameters whose scope lies outside it, and the unit owning the
scope takes them with every place they appear (see ``ownership.owned_params``). Wrapping by hand
in an order that splits a tie, or wrapping a module that is also reachable under another,
unwrapped name, is refused at wrap time naming both paths.
"""

from typing import Dict, List, Tuple

from torch import nn

from vistrain.fsdp import registry
from vistrain.torch_compat import child_modules, own_parameters


def _places(root: nn.Module):
    """id(param) -> [(path, module, attr)], each distinct (module, attr) once."""
    places: Dict[int, List[Tuple[str, nn.Module, str]]] = {}
    seen = set()
    for path, module in root.named_modules(remove_duplicate=False):
        for attr, param in own_parameters(module).items():
            if param is None or (id(module), attr) in seen:
                continue
            seen.add((id(module), attr))
            places.setdefault(id(param), []).append((path, module, attr))
    return places


def _common_prefix(paths: List[str]) -> str:
    parts = [p.split(".")[:-1] for p in paths]  # the module path of each "module.attr"
    common = []
    for level in zip(*parts):
        if len(set(level)) > 1:
            break
        common.append(level[0])
    return ".".join(common)


def mark_tied_params(root: nn.Module) -> None:
    """Give every parameter used in several places the lowest module containing all of them."""
    params = {id(p): p for _, p in root.named_parameters(remove_duplicate=False)}
    for key, where in _places(root).items():
        if len(where) < 2:
            continue
        names = [f"{path}.{attr}" if path else attr for path, _, attr in where]
        scope = root.get_submodule(_common_prefix(names))
        registry.mark_tied(params[key], scope, names)


def module_references(root: nn.Module) -> Dict[int, List[Tuple[nn.Module, str]]]:
    """id(module) -> every (parent, child name) holding it; more than one for shared modules."""
    refs: Dict[int, List[Tuple[nn.Module, str]]] = {}
    for parent in root.modules():
        for name, child in child_modules(parent).items():
            if child is not None:
                refs.setdefault(id(child), []).append((parent, name))
    return refs


def check_untied_leftovers(root: nn.Module) -> None:
    """After ``auto_wrap(wrap_root=False)``: a tied parameter no unit could own is an error."""
    for param in root.parameters():
        tie = registry.tie_of(param)
        if tie is not None and registry.replaced_by(param) is None:
            names = tie[1]
            raise ValueError(
                f"tied parameter {' = '.join(names)}: no sharded unit contains all its users; "
                "wrap their common parent (or the root)"
            )
