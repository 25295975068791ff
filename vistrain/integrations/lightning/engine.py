"""Every call the Lightning strategy makes into the sharded engine (``vistrain.fsdp``), in one
place: a change of the engine's API is a change of this module only.

The strategy wraps the whole LightningModule in one root unit and, through the wrap policy
(default: each immediate child holding parameters), its submodules in nested units. The root
owns what no nested unit holds: the LightningModule's own parameters (a temperature...).
"""

import contextlib
import inspect
from typing import Callable, Dict, Hashable, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torch import nn

from vistrain.fsdp import (
    Backend,
    FullyShardedDataParallel,
    Precision,
    ShardedGradScaler,
    auto_wrap,
    backend_of,
    by_class,
    by_size,
    shard_handle,
    shard_origins,
)
from vistrain.fsdp.grads import clip_grad_norm_
from vistrain.integrations.lightning.errors import StrategyError

Place = Tuple[int, str]  # (id(module), attribute): where a parameter lives in the module tree
Policy = Callable[[nn.Module], Optional[dict]]


def unit_option_names() -> List[str]:
    """Options of a unit (``FullyShardedDataParallel``) the strategy passes through; ``root``
    (the model's ``RootOptions``) goes to the root unit only."""
    names = list(inspect.signature(FullyShardedDataParallel.__init__).parameters)
    return [
        n
        for n in names
        if n not in ("self", "module", "param_group_fn", "precision", "reshard_after_forward")
    ]


def unit_precision(mixed, device) -> Precision:
    """The engine's precision for ``mixed``: a ``Precision`` as given; True gathers and computes
    in bf16 on CPU, fp16 on CUDA (the shards stay fp32); False in the parameters' dtype."""
    if isinstance(mixed, Precision):
        return mixed
    if not mixed:
        return Precision()
    return Precision(compute_dtype=torch.float16 if torch.device(device).type == "cuda" else torch.bfloat16)


def build_policy(spec, module: nn.Module) -> Policy:
    """The engine's wrap policy for ``spec``: None (one unit per immediate child of ``module``
    holding parameters, see :func:`_immediate_children`), an int (``by_size``), a class, a
    list/set of classes or {class: overrides} (``by_class``), or a policy callable
    (``by_class(...)``, ``by_size(...)``...)."""
    policy = _policy(spec, module)
    # ModuleList / ModuleDict have no forward: a unit around one would never run
    return lambda m: None if isinstance(m, (nn.ModuleList, nn.ModuleDict)) else policy(m)


def _policy(spec, module: nn.Module) -> Policy:
    if spec is None:
        children = {id(c) for c in _immediate_children(module) if next(c.parameters(), None) is not None}
        return lambda m: {} if id(m) in children else None
    if isinstance(spec, int) and not isinstance(spec, bool):
        return by_size(spec)
    if isinstance(spec, type):
        return by_class([spec])
    if isinstance(spec, (dict, list, tuple, set, frozenset)) and all(isinstance(c, type) for c in spec):
        return by_class(spec)
    if callable(spec):
        return spec
    raise StrategyError(
        f"auto_wrap_policy={spec!r}: give module classes (a list, or {{class: options}}), a "
        "minimum parameter count, or an engine policy such as vistrain.fsdp.by_class(...)"
    )


def _immediate_children(module: nn.Module) -> List[nn.Module]:
    """``module``'s children, with ``ModuleList`` / ``ModuleDict`` children replaced by their
    items (code indexes and iterates them; they have no forward). A ``Sequential`` is called,
    so it stays one unit: its layers then share the unit's boundary casts (see docs/lightning.md)."""
    found = []
    for child in module.children():
        if isinstance(child, (nn.ModuleList, nn.ModuleDict)):
            found += _immediate_children(child)
        else:
            found.append(child)
    return found


def parameter_places(module: nn.Module) -> Dict[int, Place]:
    """id(parameter) -> where it lives, for every parameter of ``module`` (before wrapping)."""
    return {id(p): (id(m), attr) for m in module.modules() for attr, p in m.named_parameters(recurse=False)}


def wrap(module: nn.Module, policy: Policy, options: dict, group_of: Callable[[nn.Parameter], Hashable]):
    """Shard ``module`` (collective): nested units where ``policy`` says, the root around it.

    Parameters with different ``group_of`` keys never share a flat shard, so each optimizer
    param group can hold exactly the shards of its parameters.
    """
    options = dict(options)
    root = options.pop("root", None)
    return auto_wrap(
        module, policy, root=root, param_group_fn=lambda fqn, sub, param: group_of(param), **options
    )


def point_optimizers_at_shards(root, optimizers: Sequence, places: Dict[int, Place]) -> None:
    """In every param group, put the shards holding its (original, now replaced) parameters in
    their place; ``places`` is :func:`parameter_places` of the module before wrapping."""
    shard_at: Dict[Place, nn.Parameter] = {}
    for shard in root.parameters():
        for origin in shard_origins(shard):
            for sub, attr in origin.places():
                shard_at[(id(sub), attr)] = shard
    for optimizer in optimizers:
        for group in optimizer.param_groups:
            shards: List[nn.Parameter] = []
            for param in group["params"]:
                if id(param) not in places:
                    raise StrategyError(
                        "configure_optimizers returned a tensor that is no parameter of the "
                        "LightningModule; under vistrain_fsdp every optimized tensor is a module parameter"
                    )
                shard = shard_at[places[id(param)]]
                if all(shard is not s for s in shards):
                    shards.append(shard)
            group["params"][:] = shards  # in place: LBFGS and Lightning's wrappers share the list


def root_owned_names(root) -> List[str]:
    """Names of the parameters the root unit itself holds (those of no nested unit)."""
    return [o.fqn for shard in root.parameters(recurse=False) for o in shard_origins(shard)]


def clip_global_grad_norm_(params: Sequence[torch.Tensor], max_norm: float) -> torch.Tensor:
    """``torch.nn.utils.clip_grad_norm_`` of the unsharded parameters, on their shards: the 2-norm
    over every rank's shards (one all-reduce), every shard scaled by the same factor."""
    params = [p for p in params if p.grad is not None]
    if not params:
        return torch.zeros(())
    handle = shard_handle(params[0])
    if handle is None or any(shard_handle(p) is None for p in params):
        raise StrategyError(
            "gradient clipping under vistrain_fsdp needs an optimizer holding model parameters only"
        )
    return clip_grad_norm_(params, max_norm, 2.0, handle.groups.shard, params[0].grad.device)


def is_wrapped(model: nn.Module) -> bool:
    return backend_of(model) is Backend.BUILTIN


def no_sync(root):
    """Gradients accumulate on each rank, unreduced, inside the block (root only)."""
    return root.no_sync()


def broadcast_buffers(model: nn.Module) -> None:
    """Every rank takes rank 0's buffers (BatchNorm statistics). DDP's forward does this before
    the first forward after a training step, so its evaluation runs on rank 0's statistics; the
    engine's root broadcasts before training forwards only."""
    for buffer in model.buffers():
        dist.broadcast(buffer, src=0)


def bind_step_in_backward(root, optimizer) -> None:
    """Step ``optimizer`` on each shard as soon as its gradient is final in backward."""
    root.apply_optimizer_in_backward(optimizer)


def open_step(root, module: nn.Module) -> None:
    """The root's training forward around nothing: the first one builds the model's shared
    state; each gathers the root's own parameters (kept until the end of backward) and
    broadcasts buffers, as DDP's forward does. Code run afterwards outside the root's forward
    (a manual-optimization ``training_step``) then uses the nested units as usual."""
    previous = module.__dict__.get("forward")
    module.forward = _nothing  # the root calls module(); Lightning redirects its steps the same way
    try:
        root()
    finally:
        if previous is None:
            del module.forward
        else:
            module.forward = previous


def _nothing(*args, **kwargs) -> None:
    return None


def sharded_scaler(device: str, like=None) -> ShardedGradScaler:
    """fp16 loss scaling whose inf/NaN check agrees over the ranks holding shards; carries the
    settings (scale, growth...) of the torch ``GradScaler`` ``like`` when given."""
    if like is not None and not like.is_enabled():
        return ShardedGradScaler(device, enabled=False)
    scaler = ShardedGradScaler(device)
    if like is not None:
        scaler.load_state_dict(like.state_dict())
    return scaler


def is_sharded_scaler(scaler) -> bool:
    return isinstance(scaler, ShardedGradScaler)


@torch.no_grad()
def unwrap(root, optimizers: Sequence) -> nn.Module:
    """The module ``root`` wraps, plain again, and ``optimizers`` pointed at its parameters.

    Each flat parameter is gathered in turn (device memory grows by one at a time) into host
    memory: new ``nn.Parameter`` s in place of the engine's views (tied ones stay one), then the
    optimizer state shaped like the shard (momentum, Adam's moments) sliced the same way, scalars
    (``step``) copied; submodules return in place of their units. Collective: every rank ends
    with the whole model and optimizer state, as under DDP.
    """
    plain: Dict[int, List[nn.Parameter]] = {}  # id(shard) -> its original parameters, rebuilt
    for shard in list(root.parameters()):
        handle = shard_handle(shard)
        full = handle.gather_full_copy().cpu()
        plain[id(shard)] = []
        for origin in handle.origins:
            param = nn.Parameter(_piece(full, origin), requires_grad=shard.requires_grad)
            for sub, attr in origin.places():
                sub.__dict__.pop(attr, None)  # the engine's placeholder attribute
                sub.register_parameter(attr, param)
            plain[id(shard)].append(param)
    for optimizer in optimizers:
        _unshard_optimizer(optimizer, plain)
    _replace_units(root.module)
    return root.module


def _piece(full: torch.Tensor, origin) -> torch.Tensor:
    """Original parameter ``origin``'s values inside a gathered flat tensor, as its own tensor."""
    return full[origin.flat_offset : origin.flat_offset + origin.numel].view(origin.shape).clone()


def _unshard_optimizer(optimizer, plain: Dict[int, List[nn.Parameter]]) -> None:
    state = {}
    for group in optimizer.param_groups:
        params = []
        for shard in group["params"]:
            handle, mine = shard_handle(shard), optimizer.state.get(shard, {})
            shaped = {
                k: v for k, v in mine.items() if torch.is_tensor(v) and v.dim() > 0 and v.shape == shard.shape
            }
            gathered = {k: _gather_shard(v, handle.groups.shard).cpu() for k, v in sorted(shaped.items())}
            for origin, param in zip(handle.origins, plain[id(shard)]):
                if mine:
                    entry = {
                        k: v.clone() if torch.is_tensor(v) else v for k, v in mine.items() if k not in shaped
                    }
                    state[param] = {**entry, **{k: _piece(v, origin) for k, v in gathered.items()}}
                params.append(param)
        group["params"][:] = params
    optimizer.state.clear()
    optimizer.state.update(state)


def _gather_shard(value: torch.Tensor, group) -> torch.Tensor:
    """Every rank's ``value`` (shaped like its shard) concatenated: the padded flat tensor."""
    out = value.new_empty(value.numel() * dist.get_world_size(group))
    dist.all_gather(list(out.chunk(dist.get_world_size(group))), value.detach().contiguous(), group=group)
    return out


def _replace_units(parent: nn.Module) -> None:
    for name, child in list(parent.named_children()):
        if is_wrapped(child):
            child = child.module
            setattr(parent, name, child)
        _replace_units(child)


@contextlib.contextmanager
def frozen_grads_kept(params: Sequence[nn.Parameter]):
    """Inside the block, backward leaves the ``.grad`` of ``params`` as it was.

    A unit's gradient covers all of its flat parameter even when a shard's ``requires_grad``
    was switched off after wrapping (``LightningModule.toggle_optimizer``); under DDP such a
    parameter gets no gradient, so the one the engine reduces into it is dropped here.
    """
    kept = [(p, p.grad) for p in params]
    for p, _ in kept:
        p.grad = None
    try:
        yield
    finally:
        for p, grad in kept:
            p.grad = grad
