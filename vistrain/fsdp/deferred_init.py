"""Build a model on the meta device now, create its real tensors one unit at a time later.

``model = build_on_meta(build_fn, *args)`` runs the model's own constructor with every tensor on
the meta device (no memory) while recording, per parameter and buffer (in the engine's registry,
keyed by the tensor), the ATen calls that made its values: the factory that created it (``empty``, ``zeros``, ``tensor([...])``) and the
in-place calls applied to it afterwards (``uniform_``, ``normal_``, ``fill_``, ``zero_``...),
each random call with the CPU generator state it started from. Random calls also run once on a
throw-away CPU tensor of the same shape, so the global generator advances exactly as in a normal
build and every later call sees the state it would have seen (one parameter is alive at a time).

``materialize(t)`` replays the record of one meta tensor on the CPU: the same calls, from the
same generator states, on a tensor of the same shape give the same bits as the normal build,
whatever the world size. The sharded engine calls it while flattening each unit, so a rank holds
one unit's full weights at a time. A value that cannot be replayed from its own record (written
from another tensor, partly through a view, computed out of place) fails at build time, naming
the parameter.
"""

from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from vistrain.fsdp.ownership import init_recipe_of, set_init_recipe
from vistrain.torch_compat import (
    TorchDispatchMode,
    meta_trunc_normal_refused,
    op_is_mutable,
    storage_id,
    tree_flatten,
    tree_map,
)


class _Target:
    """Placeholder for the tensor being built inside a recorded in-place call."""


_TARGET = _Target()


@dataclass
class _Node:
    """A value computed out of place from recorded values (e.g. ``F.normalize(weight)``)."""

    func: Callable
    args: tuple
    kwargs: dict
    rng_state: Optional[torch.Tensor]


@dataclass
class _StorageRef:
    """The value of a recorded tensor after its first ``version`` calls."""

    recipe: "InitRecipe"
    version: int


@dataclass
class _Step:
    func: Callable
    args: tuple
    kwargs: dict
    rng_state: Optional[torch.Tensor]  # CPU generator state before a random call


@dataclass
class InitRecipe:
    """The calls that produced one tensor: a factory, then in-place calls on the whole tensor."""

    steps: List[_Step] = field(default_factory=list)
    unreplayable: str = ""  # why it cannot be replayed ("" when it can)

    def replay(self, version: Optional[int] = None) -> torch.Tensor:
        """The tensor after its first ``version`` calls (all by default), built on the CPU exactly
        as the recorded build did; the global generator state is left as it was."""
        saved = torch.random.get_rng_state()
        try:
            out = None
            for i, step in enumerate(self.steps[:version]):
                args = _resolve(step.args, self, i, out)
                if step.rng_state is not None:
                    torch.random.set_rng_state(step.rng_state)
                result = step.func(*args, **_on_cpu(step.kwargs))
                out = result if out is None else out
            return out
        finally:
            torch.random.set_rng_state(saved)


def _resolve(args, recipe: InitRecipe, version: int, current: Optional[torch.Tensor]):
    """Recorded arguments -> CPU values, ``current`` standing for ``recipe`` at ``version``."""

    def value(a):
        if a is _TARGET:
            return current
        if isinstance(a, _StorageRef):
            return current if a.recipe is recipe and a.version == version else a.recipe.replay(a.version)
        if isinstance(a, _Node):
            node_args = _resolve(a.args, recipe, version, current)
            if a.rng_state is not None:
                torch.random.set_rng_state(a.rng_state)
            return a.func(*node_args, **_on_cpu(a.kwargs))
        return a

    return tree_map(value, args, is_leaf=lambda a: isinstance(a, (_Node, _StorageRef, _Target)))


def _on_cpu(kwargs: dict) -> dict:
    return {k: (torch.device("cpu") if k == "device" else v) for k, v in kwargs.items()}


def _key(t: torch.Tensor) -> int:
    return storage_id(t)


def _covers_storage(t: torch.Tensor) -> bool:
    whole = t.numel() * t.element_size() == t.untyped_storage().nbytes()
    return t.storage_offset() == 0 and t.is_contiguous() and whole


class _Unknown:
    """A meta value the record cannot rebuild (e.g. part of a recorded tensor seen through a view)."""


class _Recorder(TorchDispatchMode):
    """Records, per meta storage, the calls that made its values; advances the CPU generator."""

    def __init__(self):
        super().__init__()
        self.recipes: Dict[int, InitRecipe] = {}
        self.nodes: Dict[int, _Node] = {}  # id(meta tensor) -> how it was computed
        self._alive: List[torch.Tensor] = []  # keeps storages and tensor ids unique

    def keep_alive(self, t: torch.Tensor) -> None:
        self._alive.append(t)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        rng_state = None
        seeded = torch.Tag.nondeterministic_seeded in func.tags
        if seeded:
            if kwargs.get("generator") is not None:
                raise ValueError(f"{func}: initialisation with an explicit generator cannot be recorded")
            rng_state = torch.random.get_rng_state()
        out = func(*args, **kwargs)
        if seeded and _on_meta((args, kwargs, out)):  # a CPU draw (a builder's own) advanced it itself
            _advance_like(func, args, kwargs)
        if op_is_mutable(func):
            self._record_in_place(func, args, kwargs, rng_state)
        elif not any(isinstance(a, torch.Tensor) and a.is_meta for a in tree_flatten((args, kwargs))[0]):
            self._record_factory(func, args, kwargs, rng_state, out)
        else:
            self._record_node(func, args, kwargs, rng_state, out)
        return out

    def _refs(self, tree):
        """Meta tensors in ``tree`` -> references to how they were made (``_Unknown`` if not known)."""

        def ref(a):
            if not (isinstance(a, torch.Tensor) and a.is_meta):
                return a
            if id(a) in self.nodes:
                return self.nodes[id(a)]
            recipe = self.recipes.get(_key(a))
            if recipe is not None and _covers_storage(a) and not recipe.unreplayable:
                return _StorageRef(recipe, len(recipe.steps))
            return _Unknown()

        return tree_map(ref, tree)

    def _record_factory(self, func, args, kwargs, rng_state, out) -> None:
        captured = tree_map(lambda a: a.clone() if isinstance(a, torch.Tensor) else a, (args, kwargs))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.is_meta:
                self._alive.append(t)
                self.recipes[_key(t)] = InitRecipe([_Step(func, captured[0], captured[1], rng_state)])

    def _record_node(self, func, args, kwargs, rng_state, out) -> None:
        if not isinstance(out, torch.Tensor):
            return  # several outputs: not needed by any initialisation we know
        refs = self._refs((args, kwargs))
        if any(isinstance(r, _Unknown) for r in tree_flatten(refs)[0]):
            return
        self._alive.append(out)
        node = _Node(func, refs[0], refs[1], rng_state)
        self.nodes[id(out)] = node
        # a parameter may wrap this value (timm's ``nn.Parameter(init * torch.ones(d))``) and be
        # changed in place afterwards: its storage gets a record starting from the node
        self.recipes[_key(out)] = InitRecipe([_Step(_value_of, (node,), {}, None)])

    def _record_in_place(self, func, args, kwargs, rng_state) -> None:
        target = args[0]
        if not (isinstance(target, torch.Tensor) and target.is_meta) or _key(target) not in self.recipes:
            return
        recipe = self.recipes[_key(target)]
        others = self._refs((tuple(args[1:]), kwargs))
        if not _covers_storage(target) or any(isinstance(r, _Unknown) for r in tree_flatten(others)[0]):
            recipe.unreplayable = (
                recipe.unreplayable or f"{func} writes it through a view or from an unknown value"
            )
            return
        recipe.steps.append(_Step(func, (_TARGET,) + others[0], others[1], rng_state))


def _value_of(value: torch.Tensor) -> torch.Tensor:
    """The first step of a record that starts from a value computed out of place."""
    return value


class _TensorLiterals(TorchFunctionMode):
    """``torch.tensor(data)`` on the meta device reaches no ATen call the recorder could see."""

    def __init__(self, recorder: _Recorder):
        super().__init__()
        self.recorder = recorder

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func in (torch.tensor, torch.as_tensor) and isinstance(out, torch.Tensor) and out.is_meta:
            data = tree_map(lambda a: a.clone() if isinstance(a, torch.Tensor) else a, args)
            step = _Step(func, data, {**kwargs, "device": torch.device("cpu")}, None)
            self.recorder.keep_alive(out)
            self.recorder.recipes[_key(out)] = InitRecipe([step])
        return out


def _on_meta(tree) -> bool:
    return any(isinstance(t, torch.Tensor) and t.is_meta for t in tree_flatten(tree)[0])


def _advance_like(func, args, kwargs) -> None:
    """Run a random call once on CPU tensors of the same shapes: the generator moves as it would."""
    cpu = tree_map(
        lambda a: torch.empty_like(a, device="cpu") if isinstance(a, torch.Tensor) and a.is_meta else a,
        (args, kwargs),
    )
    func(*cpu[0], **_on_cpu(cpu[1]))


def build_on_meta(build_fn: Callable[..., nn.Module], *args: Any, **kwargs: Any) -> nn.Module:
    """``build_fn(*args, **kwargs)`` with every tensor on the meta device, each parameter and
    buffer carrying the record ``materialize`` replays. Raises when one cannot be replayed."""
    recorder = _Recorder()
    refuse = meta_trunc_normal_refused(_refuse_trunc_normal)
    with torch.device("meta"), refuse, _TensorLiterals(recorder), recorder:
        model = build_fn(*args, **kwargs)
    for name, tensor in list(model.named_parameters()) + list(model.named_buffers()):
        recipe = recorder.recipes.get(_key(tensor)) if tensor.is_meta else None
        if recipe is None or recipe.unreplayable:
            why = recipe.unreplayable if recipe is not None else "its value was computed out of place"
            raise ValueError(f"cannot initialise {name} unit by unit: {why}")
        set_init_recipe(tensor, recipe)
    return model


def _refuse_trunc_normal(tensor: torch.Tensor) -> None:
    raise ValueError(
        f"cannot initialise a tensor of shape {tuple(tensor.shape)} unit by unit: torch.nn.init.trunc_normal_ "
        "leaves meta tensors untouched and draws a data-dependent number of values"
    )


def defer_value(tensor: torch.Tensor, make: Callable[[], torch.Tensor]) -> None:
    """Give meta ``tensor`` the value ``make()`` (a CPU tensor of its shape and dtype), computed
    when the sharded engine creates its unit; replaces the recorded initialisation."""
    set_init_recipe(tensor, InitRecipe([_Step(make, (), {}, None)]))


def materialize(tensor: torch.Tensor) -> torch.Tensor:
    """A real CPU tensor with the values the normal build gives ``tensor``; non-meta: itself."""
    if not tensor.is_meta:
        return tensor.detach()
    recipe = init_recipe_of(tensor)
    if recipe is None:
        raise ValueError(
            f"a meta tensor of shape {tuple(tensor.shape)} has no recorded initialisation: build the "
            "model with vistrain.fsdp.build_on_meta"
        )
    return recipe.replay()
