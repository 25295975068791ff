"""Every call the Lightning strategy makes into the sharded engine (``vistrain.fsdp``), in one
place: a change of the engine's API is a change of this module only.

The strategy wraps the whole LightningModule in one root unit and, through the wrap policy
(default: each immediate child holding parameters), its submodules in nested units. The root
owns what no nested unit holds: the LightningModule's own parameters (a temperature...).
"""

import inspect
from typing import Callable, Dict, List, Optional, Sequence, Tuple

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
)
from vistrain.fsdp.grads import clip_grad_norm_
from vistrain.integrations.lightning.errors import StrategyError

# FullyShardedDataParallel's arguments that are no unit options of the strategy: its own arguments
# (reshard_after_forward, gather_public_methods; precision from mixed_precision) and param_group_fn
NOT_UNIT_OPTIONS = (
    "self",
    "module",
    "param_group_fn",
    "precision",
    "reshard_after_forward",
    "gather_public_methods",
)
Place = Tuple[int, str]  # (id(module), attribute): where a parameter lives in the module tree
Policy = Callable[[nn.Module], Optional[dict]]


def unit_option_names() -> List[str]:
    """Options of a unit (``FullyShardedDataParallel``) the strategy passes through; ``root``
    (the model's ``RootOptions``) goes to the root unit only."""
    names = list(inspect.signature(FullyShardedDataParallel.__init__).parameters)
    return [n for n in names if n not in NOT_UNIT_OPTIONS]


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


def wrap(module: nn.Module, policy: Policy, options: dict):
    """Shard ``module`` (collective): nested units where ``policy`` says, the root around it.

    Param groups need no flat shards of their own (optimizers hold the local parameters), so the
    layout depends on the modules alone: a teacher wrapped like its student pairs with it.
    """
    options = dict(options)
    root = options.pop("root", None)
    return auto_wrap(module, policy, root=root, **options)


def point_optimizers_at_shards(root, optimizers: Sequence, places: Dict[int, Place]) -> None:
    """In every param group, put the local parameter now registered where each original
    parameter was; ``places`` is :func:`parameter_places` of the module before wrapping."""
    local_at: Dict[Place, nn.Parameter] = {}
    for sub in root.modules():
        for attr, param in sub.named_parameters(recurse=False):
            local_at[(id(sub), attr)] = param
    for optimizer in optimizers:
        for group in optimizer.param_groups:
            params: List[nn.Parameter] = []
            for param in group["params"]:
                if id(param) not in places:
                    raise StrategyError(
                        "configure_optimizers returned a tensor that is no parameter of the "
                        "LightningModule; under vistrain_fsdp every optimized tensor is a module parameter"
                    )
                local = local_at[places[id(param)]]
                if all(local is not p for p in params):
                    params.append(local)
            group["params"][:] = params  # in place: LBFGS and Lightning's wrappers share the list


def root_owned_names(root) -> List[str]:
    """Names of the parameters the root unit itself holds (those of no nested unit)."""
    return [o.fqn for handle in root.unit_state.handles for o in handle.origins]


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
    memory: new ``nn.Parameter`` s in place of the engine's local ones (tied ones stay one), then
    the optimizer state shaped like the local parameters (momentum, Adam's moments) gathered the
    same way, scalars (``step``) taken from a rank that holds the parameter; submodules return in
    place of their units. Collective: every rank ends with the whole model and optimizer state,
    as under DDP.
    """
    plain: Dict[int, nn.Parameter] = {}  # id(local parameter) -> the original one, rebuilt
    handles = [h for unit in root.units() for h in unit.unit_state.handles]
    for handle in handles:
        full = handle.gather_full_copy().cpu()
        for origin, local in zip(handle.origins, handle.local_params):
            param = nn.Parameter(_piece(full, origin), requires_grad=local.requires_grad)
            for sub, attr in origin.places():
                sub.__dict__.pop(attr, None)
                sub.register_parameter(attr, param)
            plain[id(local)] = param
    for optimizer in optimizers:
        _unshard_optimizer(optimizer, handles, plain)
    _replace_units(root.module)
    return root.module


def _piece(full: torch.Tensor, origin) -> torch.Tensor:
    """Original parameter ``origin``'s values inside a gathered flat tensor, as its own tensor."""
    return full[origin.flat_offset : origin.flat_offset + origin.numel].view(origin.shape).clone()


def _unshard_optimizer(optimizer, handles, plain: Dict[int, nn.Parameter]) -> None:
    """The optimizer's per-parameter state, gathered per handle: each state tensor shaped like
    a local parameter is laid into a shard-sized buffer at that parameter's place, the buffers
    all-gathered and cut into the original parameters; ranks agree on the keys first."""
    states = optimizer.state
    local = {
        id(h): {k for p in h.local_params for k, v in states.get(p, {}).items() if _shaped(v, p)}
        for h in handles
    }
    scalars = {
        o.fqn: {k: v for k, v in states.get(p, {}).items() if not _shaped(v, p)}
        for h in handles
        for o, p in zip(h.origins, h.local_params)
        if p.numel() and states.get(p)
    }
    with_state = {o.fqn for h in handles for o, p in zip(h.origins, h.local_params) if states.get(p)}
    everyone = [None] * dist.get_world_size()
    mine = ({i: sorted(k) for i, k in enumerate(local.values())}, scalars, with_state)
    dist.all_gather_object(everyone, mine)
    keys = [sorted({k for keys_of, _, _ in everyone for k in keys_of[i]}) for i in range(len(handles))]
    scalars = {fqn: value for _, found, _ in reversed(everyone) for fqn, value in found.items()}
    with_state = set().union(*(found for _, _, found in everyone))
    state = {}
    for handle, handle_keys in zip(handles, keys):
        gathered = {k: _gather_state(handle, states, k).cpu() for k in handle_keys}
        for origin, param in zip(handle.origins, handle.local_params):
            if origin.fqn in with_state:
                entry = {
                    k: v.clone() if torch.is_tensor(v) else v for k, v in scalars.get(origin.fqn, {}).items()
                }
                state[plain[id(param)]] = {**entry, **{k: _piece(v, origin) for k, v in gathered.items()}}
    for group in optimizer.param_groups:
        group["params"][:] = [plain[id(p)] for p in group["params"]]
    optimizer.state.clear()
    optimizer.state.update(state)


def _shaped(value, param) -> bool:
    return torch.is_tensor(value) and value.dim() > 0 and value.shape == param.shape


def _gather_state(handle, states, key: str) -> torch.Tensor:
    """Every rank's state ``key`` of the handle's local parameters: the padded flat tensor."""
    mine = torch.zeros(handle.shard_numel, dtype=handle.shard.dtype, device=handle.shard.device)
    for i, s_start, _, n in handle.local_slices():
        value = states.get(handle.local_params[i], {}).get(key)
        if value is not None:
            mine[s_start : s_start + n].copy_(value.reshape(-1))
    group = handle.groups.shard
    out = mine.new_empty(mine.numel() * dist.get_world_size(group))
    dist.all_gather(list(out.chunk(dist.get_world_size(group))), mine, group=group)
    return out


def _replace_units(parent: nn.Module) -> None:
    for name, child in list(parent.named_children()):
        if is_wrapped(child):
            child = child.module
            setattr(parent, name, child)
        _replace_units(child)
