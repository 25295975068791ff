"""What the engine knows about the user's objects, and which unit owns what.

**The registry.** A parameter replaced by a flat shard, the handle and origin behind a local
parameter, the unit owning a module, the scope of a tied parameter, the recorded initialisation of
a meta tensor: each is an entry in a weak map keyed by the object (by identity: a tensor's ``==`` is
elementwise), never an attribute pinned on it. Entries die with their keys; values are weak
references where they name engine objects, so the registry keeps nothing alive. The optimizer
check lives here too: torch offers only a process-wide step pre-hook to see an optimizer the
engine did not build, so it is installed once, and each optimizer is scanned on its first step
and again only when its parameter lists change size.

**Ownership.** A unit owns the parameters of its module not inside a nested unit. A parameter
tied across modules (encoder/decoder weight sharing) must live in exactly one flat parameter, in
the lowest unit that owns every module using it, or the tie is silently lost: ``auto_wrap``
marks each tied parameter with the lowest common ancestor of its users (its *scope*); a unit
skips tied parameters whose scope lies outside it, and the unit owning the scope takes them with
every place they appear. Wrapping by hand in an order that splits a tie, or wrapping a module
that is also reachable under another, unwrapped name, is refused at wrap time naming both paths.
"""

import weakref
from typing import Dict, List, Optional, Tuple

import torch
import torch.distributed as dist
from torch import nn
from torch.optim.optimizer import register_optimizer_step_pre_hook
from torch.utils.weak import WeakIdKeyDictionary

from vistrain.torch_compat import child_modules, own_parameters

# names the wrapper adds to a module tree
WRAPPED_NAME = "_fsdp_wrapped_module"  # attribute holding the wrapped module inside each unit


def clean_name(name: str) -> str:
    """Drop wrapper path components: 'a._fsdp_wrapped_module.b' -> 'a.b'."""
    return name.replace(WRAPPED_NAME + ".", "").replace("." + WRAPPED_NAME, "").replace(WRAPPED_NAME, "")


class _Registry:
    def __init__(self):
        self.replaced = WeakIdKeyDictionary()  # original param -> (weakref(unit), local fqn)
        self.owner_of_module = WeakIdKeyDictionary()  # module -> weakref(unit owning it)
        self.tie_of_param = WeakIdKeyDictionary()  # tied param -> (weakref(scope module), names)
        self.checked_optimizers = WeakIdKeyDictionary()  # optimizer -> param counts when checked
        self.init_recipe = WeakIdKeyDictionary()  # meta tensor -> how to create its values
        # local parameter -> (weakref(FlatParamHandle), origin index)
        self.origin_of_local = WeakIdKeyDictionary()
        self.forward_methods = WeakIdKeyDictionary()  # module -> names gathered like its forward
        self.shard_methods = WeakIdKeyDictionary()  # module -> names never gathered automatically
        self.optimizer_hook = None


_REGISTRY = _Registry()


def register_local_param(param: nn.Parameter, handle, index: int) -> None:
    """``param`` is this rank's part of ``handle.origins[index]``, a view of its shard."""
    _REGISTRY.origin_of_local[param] = (weakref.ref(handle), index)


def local_param_of(param):
    """(FlatParamHandle, origin index) of a local parameter of the engine, or None."""
    entry = _REGISTRY.origin_of_local.get(param)
    if entry is None:
        return None
    handle = entry[0]()
    return None if handle is None else (handle, entry[1])


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


def set_forward_methods(module: nn.Module, names) -> None:
    """``module``'s methods ``names`` gather its unit's weights as its forward does."""
    _REGISTRY.forward_methods[module] = frozenset(names)


def forward_methods_of(module: nn.Module) -> frozenset:
    """The names :func:`set_forward_methods` registered for ``module`` (empty: none)."""
    return _REGISTRY.forward_methods.get(module, frozenset())


def set_shard_methods(module: nn.Module, names) -> None:
    """``module``'s methods ``names`` run on the shards even with ``gather_public_methods``."""
    _REGISTRY.shard_methods[module] = frozenset(names)


def shard_methods_of(module: nn.Module) -> frozenset:
    """The names :func:`set_shard_methods` registered for ``module`` (empty: none)."""
    return _REGISTRY.shard_methods.get(module, frozenset())


def set_init_recipe(tensor, recipe) -> None:
    """``tensor`` (meta) gets its values from ``recipe`` when its unit is created (deferred_init)."""
    _REGISTRY.init_recipe[tensor] = recipe


def init_recipe_of(tensor):
    """The recipe :func:`set_init_recipe` gave ``tensor``, or None."""
    return _REGISTRY.init_recipe.get(tensor)


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
            if param is not None and tie_of(param) is not None and _in_scope(param, owned):
                _add_place(found, clean_name(f"{path}.{attr}"), sub, attr, param)
    return [tuple(entry) for entry in found.values()]


def _in_scope(param, owned) -> bool:
    tie = tie_of(param)
    return tie is None or id(tie[0]) in owned


def _add_place(found, fqn, sub, attr, param) -> None:
    replaced = replaced_by(param)
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
    if owner_of(sub) is not None:
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
        mark_tied(params[key], scope, names)


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
        tie = tie_of(param)
        if tie is not None and replaced_by(param) is None:
            names = tie[1]
            raise ValueError(
                f"tied parameter {' = '.join(names)}: no sharded unit contains all its users; "
                "wrap their common parent (or the root)"
            )
