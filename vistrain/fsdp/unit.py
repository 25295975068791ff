"""One sharded unit: its flat-parameter handles, its phase and every change to it (as FSDP2's
``FSDPParamGroup``), and how a unit is built from the module it wraps.

A ``UnitState`` owns the unit's flat-parameter handles and its :class:`Phase`.
Per training step::

    begin_forward:  all-gather the shards (prefetch the next unit's)     IDLE -> FORWARD
    end_forward:    free the full weights (ZeRO-3), hook the outputs     FORWARD -> IDLE
    pre_backward:   gather again (output hook or saved-weight unpack)    IDLE -> BACKWARD
    post_backward:  per handle, once autograd accumulated its gradient: free the full weights,
                    hand the gradient to the model's reductions
    end_backward:   free whatever is still gathered                      BACKWARD -> IDLE

``summoned`` is the block outside training (full parameters); ``recover`` returns to IDLE after
an exception. Every phase change goes through ``_enter``. What units share (options, reductions,
order) is the ``ModelState`` the root attaches at its first forward.

The phases and their legal changes:

A unit (``UnitState``)::

    IDLE --training forward--> FORWARD --forward returns--> IDLE
    IDLE --pre-backward gather--> BACKWARD --end of backward--> IDLE
    IDLE --summon_full_params--> SUMMONED --block exits--> IDLE

A wrapped model (``ModelState``) moves only through IDLE, FORWARD (inside the root's training
forward) and BACKWARD (first backward hook of a step to autograd's final callback).

After an exception any phase may return to IDLE, but only through the owners' recovery methods,
which say so (``recovering=True``). Anything else is a bug of the engine and raises.
"""

import contextlib
import enum
import functools
import weakref
from typing import TYPE_CHECKING, Callable, Dict, List, Optional

import torch
import torch.distributed as dist
from torch import nn

from vistrain.fsdp.collectives import ShardGroups, group_ranks
from vistrain.fsdp.deferred_init import materialize
from vistrain.fsdp.flat_param import FlatParamHandle, ParamOrigin
from vistrain.fsdp.ownership import mark_replaced, owned_modules
from vistrain.fsdp.precision import Precision, iter_tensors
from vistrain.torch_compat import own_buffers

if TYPE_CHECKING:  # the ModelState imports this module
    from vistrain.fsdp.model_state import ModelState


class Phase(enum.Enum):
    IDLE = "idle"
    FORWARD = "forward"
    BACKWARD = "backward"
    SUMMONED = "summoned"  # full parameters exposed by summon_full_params


UNIT_TRANSITIONS = frozenset(
    {
        (Phase.IDLE, Phase.FORWARD),
        (Phase.FORWARD, Phase.IDLE),
        (Phase.IDLE, Phase.BACKWARD),
        (Phase.BACKWARD, Phase.IDLE),
        (Phase.IDLE, Phase.SUMMONED),
        (Phase.SUMMONED, Phase.IDLE),
    }
)

MODEL_TRANSITIONS = frozenset(
    {
        (Phase.IDLE, Phase.FORWARD),
        (Phase.FORWARD, Phase.IDLE),
        (Phase.IDLE, Phase.BACKWARD),
        (Phase.BACKWARD, Phase.IDLE),
    }
)


def checked_transition(legal: frozenset, current: Phase, target: Phase, what: str, recovering: bool) -> Phase:
    """``target`` if moving there from ``current`` is legal, else raise naming ``what``."""
    if (current, target) in legal or (recovering and target is Phase.IDLE):
        return target
    raise RuntimeError(
        f"FullyShardedDataParallel internal error: {what} cannot go from {current.value} to {target.value}"
    )


class UnitState:
    """Handles, phase and transitions of one unit.

    Args:
        handles: the unit's flat parameters (one per parameter group key).
        reshard_after_forward: free the gathered weights after forward (ZeRO-3); else they stay
            gathered to the end of backward (ZeRO-2), as they do for the root and, at every unit,
            with the model's ``find_unused_parameters``.
    """

    def __init__(self, handles: List[FlatParamHandle], reshard_after_forward: bool):
        self.handles = handles
        self.reshard_after_forward = reshard_after_forward
        self.phase = Phase.IDLE
        self.model: Optional[ModelState] = None  # attached by the root's first forward
        self.index = -1  # position in the model's units, outermost first
        self.is_root = False
        self.calls = 0  # forwards and gathered methods of this unit running now (nested ones count)
        self_ref = weakref.ref(self)  # the gradient hooks must not keep the unit alive
        for handle in handles:
            if handle.shard.requires_grad:
                handle.full.register_post_accumulate_grad_hook(
                    functools.partial(_post_accumulate_grad, self_ref, handle)
                )

    def attach(self, model: "ModelState", index: int, is_root: bool) -> None:
        """Join ``model`` as its unit ``index``; its handles wait with the model's timeout."""
        self.model, self.index, self.is_root = model, index, is_root
        for handle in self.handles:
            handle.timeout = model.options.collective_timeout
            handle.gather_group = model.gather_groups[group_ranks(handle.groups.shard)]

    @property
    def keeps_gathered(self) -> bool:
        """The weights stay gathered from forward to the end of backward."""
        return not self.reshard_after_forward or self.is_root or self.model.options.find_unused_parameters

    def _enter(self, phase: Phase, recovering: bool = False) -> None:
        self.phase = checked_transition(UNIT_TRANSITIONS, self.phase, phase, self.describe(), recovering)

    def describe(self) -> str:
        if self.model is not None:
            return f"unit '{self.model.order.names[self.index]}'"
        return f"unit of {self.handles[0].describe()}" if self.handles else "unit without parameters"

    @contextlib.contextmanager
    def call(self):
        """One forward or gathered method of the unit runs inside the block; a call made while
        another runs (``in_call``) finds the weights gathered and runs plainly."""
        self.calls += 1
        try:
            yield
        finally:
            self.calls -= 1

    @property
    def in_call(self) -> bool:
        """A forward or gathered method of this unit is running: its weights are gathered."""
        return self.calls > 0

    # -- gathering ------------------------------------------------------------------------------
    def unshard(self) -> None:
        for handle in self.handles:
            handle.start_unshard()
        for handle in self.handles:
            handle.wait_unshard()

    def reshard(self) -> None:
        for handle in self.handles:
            self._reshard_handle(handle)

    def _reshard_handle(self, handle: FlatParamHandle) -> None:
        self.model.heap.freed(handle.reshard())

    def prefetch(self, for_backward: bool) -> None:
        """Start this unit's gathers ahead of its turn (not again once its backward began)."""
        if for_backward and self.phase is Phase.BACKWARD:
            return
        for handle in self.handles:
            handle.start_unshard()

    def _prefetch_neighbours(self, step: int) -> None:
        depth = self.model.options.prefetch_depth
        for index in self.model.order.neighbours(self.index, step, depth):
            self.model.units[index].prefetch(for_backward=step < 0)

    # -- forward ------------------------------------------------------------------------------------
    def begin_forward(self) -> bool:
        """Before the wrapped module runs: gather. Returns whether this is a training forward
        (grad enabled, not a recomputation inside backward)."""
        model = self.model
        training = torch.is_grad_enabled() and model.phase is not Phase.BACKWARD
        if self.is_root:
            model.begin_forward(training)
        if training:
            model.order.record_forward(self.index)
            self._enter(Phase.FORWARD)
        self.unshard()  # the gather also points the modules at fresh views of the weights
        if training and not self.is_root:
            # the root's forward may run the user's code first (a LightningModule's
            # training_step: an EMA, a normalisation): the first unit gathers when it runs
            self._prefetch_neighbours(+1)
        return training

    def end_forward(self, outputs, training: bool):
        """After the wrapped module ran: free or keep the weights, hook the outputs' backward."""
        model = self.model
        grad_enabled = torch.is_grad_enabled()
        if model.phase is not Phase.BACKWARD and (not grad_enabled or not self.keeps_gathered):
            self.reshard()
            model.heap.at_unit_boundary()
        if grad_enabled:
            for tensor in iter_tensors(outputs):  # an early start; saved-weight hooks guarantee it
                if tensor.requires_grad:
                    tensor.register_hook(self._pre_backward_hook)
        if training:
            self._enter(Phase.IDLE)
            if self.is_root:
                model.end_forward()
        return outputs

    # -- backward -------------------------------------------------------------------------------
    def _pre_backward_hook(self, grad):
        self.pre_backward()
        return grad

    def pre_backward(self) -> None:
        """Before the unit's backward reads its weights (output hook or saved-weight unpack)."""
        self.model.mark_backward()
        if self.phase is not Phase.BACKWARD:
            self._enter(Phase.BACKWARD)
            self.model.record_backward(self.index)
            self.unshard()
            self._prefetch_neighbours(-1)

    def post_backward(self, handle: FlatParamHandle, grad: torch.Tensor) -> None:
        """Autograd has accumulated ``handle``'s full gradient: free the weights, reduce it."""
        self.model.mark_backward()  # also when no earlier hook fired (only intermediates on self)
        self._reshard_handle(handle)
        self.model.reduce_gradient(handle, grad)
        self.model.heap.at_unit_boundary()

    def end_backward(self) -> None:
        self.reshard()
        if self.phase is Phase.BACKWARD:
            self._enter(Phase.IDLE)

    def recover(self) -> None:
        """After an interrupted step: drop the gradients, free the weights, back to IDLE."""
        for handle in self.handles:
            handle.take_full_grad()
            handle.shard_grad.drop_step()
            self._reshard_handle(handle)
        self._enter(Phase.IDLE, recovering=True)

    # -- outside training ---------------------------------------------------------------------
    @contextlib.contextmanager
    def summoned(self, writeback: bool):
        """Full fp32 copies of the weights registered as ordinary parameters inside the block."""
        self._enter(Phase.SUMMONED)
        copies = []
        try:
            for handle in self.handles:
                full = handle.gather_full_copy()
                handle.expose_as_parameters(full)
                copies.append((handle, full))
            yield
        finally:
            for handle, full in copies:
                if writeback:
                    handle.write_back(full)
                handle.restore_attributes()
            self._enter(Phase.IDLE)


def _post_accumulate_grad(unit_ref, handle: FlatParamHandle, _full: torch.Tensor) -> None:
    unit: Optional[UnitState] = unit_ref()
    grad = handle.take_full_grad()
    if unit is not None and grad is not None:
        unit.post_backward(handle, grad)


# -- building a unit --------------------------------------------------------------------------
def build_handles(
    owner: nn.Module,
    owned: list,
    groups: ShardGroups,
    precision: Precision,
    devices: tuple,
    flatten: bool,
    group_fn: Optional[Callable],
    sync: bool,
) -> List[FlatParamHandle]:
    """One handle per key (dtype, ``group_fn(fqn, module, param)``; with
    ``flatten`` False one per parameter) over ``owned`` (``ownership.owned_params`` of the
    module ``owner`` wraps). ``devices``: (compute device, shard device). The replaced original
    parameters are marked, so an optimizer built on them fails."""
    by_key: Dict[tuple, list] = {}
    for fqn, sub, attr, param, aliases in owned:
        key = (param.dtype, group_fn(fqn, sub, param) if group_fn else None)
        by_key.setdefault(key + ((fqn,) if not flatten else ()), []).append((fqn, sub, attr, param, aliases))
    handles = []
    for members in by_key.values():
        # offsets in the flat vector come from the handle's layout (``flat_param.flat_layout``)
        origins = [
            ParamOrigin(fqn, sub, attr, param.shape, 0, aliases=aliases, requires_grad=param.requires_grad)
            for fqn, sub, attr, param, aliases in members
        ]
        params = [m[3] for m in members]
        handles.append(FlatParamHandle(params, origins, groups, devices[0], precision, devices[1], sync))
        for param, origin in zip(params, origins):
            mark_replaced(param, owner, origin.local_fqn)
    return handles


def prepare_buffers(module: nn.Module, device: torch.device, groups: ShardGroups, sync: bool) -> None:
    """Create the buffers of the modules ``module``'s unit owns on ``device`` (meta ones from
    their recorded initialisation); with ``sync`` take the world's first rank's values."""
    for sub in owned_modules(module):
        buffers = own_buffers(sub)
        for name, buf in list(buffers.items()):
            if buf is None:
                continue
            buf = materialize(buf).to(device)
            if sync:
                for group in groups.data_parallel():
                    if dist.get_world_size(group) > 1:
                        dist.broadcast(buf, src=dist.get_global_rank(group, 0), group=group)
            buffers[name] = buf


def name_from_root(units: List[UnitState], prefixes: List[str]) -> None:
    """Name every handle's origins from the root: ``prefixes[i]`` is unit i's path ("" for the
    root), ``units`` those of one model, the root's first."""
    for unit, prefix in zip(units, prefixes):
        for handle in unit.handles:
            for o in handle.origins:
                o.fqn = f"{prefix}.{o.local_fqn}" if prefix else o.local_fqn
