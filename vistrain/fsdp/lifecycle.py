"""The sharded engine's training lifecycle: explicit states, typed in-flight records, recovery.

One ``RootState`` per wrapped model (held by the root unit) moves through ``TrainingState``::

    IDLE --root forward--> FORWARD --root forward returns--> IDLE   (units may stay gathered)
    IDLE --first backward hook of the step--> BACKWARD --autograd's final callback--> IDLE

An exception can leave it in FORWARD or BACKWARD (autograd drops the queued final callback
when backward raises). The next root forward, ``state_dict()``, ``summon_full_params()`` or an
explicit ``reset_iter_state()`` then waits for and discards the aborted step's reductions,
frees every gathered weight and returns to IDLE with a warning: the aborted step's gradients
never reach ``.grad``, so training goes on as if the step had been skipped.

Each unit has its own ``TrainingState``: FORWARD inside its forward, BACKWARD from its
pre-backward gather until the step ends, IDLE otherwise.
"""

import contextlib
import enum
import functools
import warnings
from dataclasses import dataclass
from typing import Dict, List, Optional

import torch
import torch.distributed as dist

from vistrain.fsdp.buffers import broadcast_buffers
from vistrain.fsdp.flat_param import FlatParamHandle
from vistrain.fsdp.timeouts import wait_within
from vistrain.torch_compat import (
    backward_running,
    current_saved_tensors_hooks,
    queue_autograd_callback,
    saved_tensors_hooks_enabled,
)


class TrainingState(enum.Enum):
    IDLE = "idle"
    FORWARD = "forward"
    BACKWARD = "backward"


@dataclass
class PendingReduction:
    """A gradient reduction started in backward; its result is added to the shard's ``.grad``
    once every rank has issued it (``work`` waited when the next reduction starts, or at the end
    of backward)."""

    handle: FlatParamHandle
    work: dist.Work
    reduced: torch.Tensor  # (shard_numel,) this rank's slice of the averaged gradient
    source: torch.Tensor  # (padded_numel,) the full gradient being reduced; alive until the wait


class RootState:
    """Bookkeeping shared by every unit of one wrapped model; lives on the root."""

    def __init__(self, root, units: list, unit_names: Dict[int, str]):
        self.root = root
        self.units = units  # outermost first: the canonical order of reductions and checks
        self.unit_names = unit_names  # id(unit) -> path from the root ("<root>" for the root)
        self.phase = TrainingState.IDLE
        self.require_grad_sync = True
        self.exec_order: List = []  # units in first-forward-call order, fixed after step one
        self.exec_order_final = False
        self.order_checked = False  # the first step's cross-rank order check has passed
        self.calls_this_step = 0
        self.backward_calls = 0
        self.pending: List[PendingReduction] = []
        # id(handle.full) -> unit: the tensors whose views the modules compute with.
        self.full_owners = {id(h.full): unit for unit in units for h in unit._handles}
        # find_unused_parameters: full gradients kept until the end of backward, by handle.
        self.deferred: Dict[FlatParamHandle, torch.Tensor] = {}

    def handles(self) -> List[FlatParamHandle]:
        return [h for unit in self.units for h in unit._handles]

    def name(self, unit) -> str:
        return self.unit_names[id(unit)]


def is_stale(state: RootState) -> bool:
    """A forward or backward that an exception interrupted (not one still running)."""
    return state.phase is TrainingState.FORWARD or (
        state.phase is TrainingState.BACKWARD and not backward_running()
    )


def begin_root_forward(state: RootState, training: bool) -> None:
    """Reset a step an exception interrupted; for training, enter FORWARD and sync buffers."""
    if is_stale(state):
        reset_iter_state(state, f"the previous {state.phase.value} did not finish")
    if not training:
        return
    state.phase = TrainingState.FORWARD
    if state.root.broadcast_buffers and state.require_grad_sync:
        broadcast_buffers(state.units, state.root.process_group, state.root.collective_timeout)


def mark_backward(state: RootState) -> None:
    """First backward hook of a step: enter BACKWARD and have autograd finalize at its end."""
    if state.phase is not TrainingState.BACKWARD:
        state.phase = TrainingState.BACKWARD
        queue_autograd_callback(state.root._finalize_backward)


def reset_iter_state(state: RootState, why: Optional[str] = None) -> None:
    """Return to IDLE after an interrupted step: wait for its collectives, discard its gradients.

    Only collectives already issued are waited on, so every rank can reset on its own.
    """
    if why is not None:
        warnings.warn(
            f"FullyShardedDataParallel: {why}; the interrupted step's gradients were discarded "
            "and its gathered weights freed",
            stacklevel=3,
        )
    for reduction in state.pending:
        wait_within(
            reduction.work,
            reduction.handle.timeout,
            "a discarded gradient reduction",
            reduction.source.device,
        )
    state.pending.clear()
    state.deferred.clear()
    for unit in state.units:
        for handle in unit._handles:
            handle.take_full_grad()
            handle.reshard()
        unit.phase = TrainingState.IDLE
    state.phase = TrainingState.IDLE


def recover_if_interrupted(state: Optional[RootState]) -> None:
    """Before gathering full parameters (state dicts): reset a stale step, refuse a running one."""
    if state is None:
        return
    if is_stale(state):
        reset_iter_state(state, f"the previous {state.phase.value} did not finish")
    elif state.phase is not TrainingState.IDLE:
        raise RuntimeError("full parameters cannot be gathered during forward or backward")


def post_backward_hook(unit_ref, handle: FlatParamHandle, _full: torch.Tensor) -> None:
    """After autograd has accumulated a handle's full gradient: start its reduction and free it.

    Under ``no_sync`` the gradient is kept locally; with ``find_unused_parameters`` it waits for
    the end of backward (``reduce_deferred``), where every rank reduces in the same order.
    """
    unit = unit_ref()
    grad = handle.take_full_grad()
    if unit is None or grad is None:
        return
    state = unit._root_state
    mark_backward(state)  # also when no earlier hook fired (only intermediates on self)
    handle.reshard()
    if not state.require_grad_sync:
        handle.accumulate_unsharded(grad)
    elif state.root.find_unused_parameters:
        state.deferred[handle] = grad
    else:
        start_reduction(state, handle, grad)


def finish_reductions(state: RootState) -> None:
    """Wait for every in-flight reduction and add its result to the shard's gradient."""
    for reduction in state.pending:
        wait_within(
            reduction.work,
            reduction.handle.timeout,
            functools.partial(_reduction_description, reduction.handle),
            reduction.source.device,
        )
        reduction.handle.accumulate_shard_grad(reduction.reduced)
    state.pending.clear()


def _reduction_description(handle: FlatParamHandle) -> str:
    return f"the gradient reduction of {handle.describe()}"


def start_reduction(state: RootState, handle: FlatParamHandle, grad: torch.Tensor) -> None:
    # The previous reduction had this handle's whole backward to overlap with; finishing it now
    # bounds the full-size gradient buffers alive at any time to this one's and one in flight
    # (gloo reduces the full vector in place: its buffer lives until the reduction is finished).
    finish_reductions(state)
    work, reduced, source = handle.start_reduce_scatter(grad)
    state.pending.append(PendingReduction(handle, work, reduced, source))


def reduce_deferred(state: RootState, group) -> None:
    """find_unused_parameters: reduce, in the canonical unit order, every handle some rank used.

    A MAX all-reduce of per-handle "has a gradient here" flags tells every rank which handles to
    reduce; a rank that did not use one contributes zeros. Handles no rank used keep ``.grad``
    as it was, as DDP leaves globally unused parameters.
    """
    handles = [h for h in state.handles() if h.shard.requires_grad]
    local = [h in state.deferred or h.unsharded_grad_acc is not None for h in handles]
    flags = torch.tensor(local, dtype=torch.uint8, device=handles[0].compute_device if handles else "cpu")
    if handles and dist.get_world_size(group) > 1:
        work = dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=group, async_op=True)
        wait_within(
            work, handles[0].timeout, "the used-parameter flags of find_unused_parameters", flags.device
        )
    for handle, used in zip(handles, flags.tolist()):
        if used:
            grad = state.deferred.pop(handle, None)
            if grad is None:
                grad = torch.zeros_like(handle.full, dtype=handle.compute_dtype).detach()
            start_reduction(state, handle, grad)
    state.deferred.clear()


class SavedWeightView:
    """What autograd stores instead of a view of a unit's gathered weights (see saved_weight_hooks)."""

    __slots__ = ("unit", "tensor")

    def __init__(self, unit, tensor: torch.Tensor):
        self.unit, self.tensor = unit, tensor


def saved_weight_hooks(state: RootState):
    """Saved-tensor hooks that gather a unit again before autograd reads its saved weights.

    Autograd keeps views of ``full`` for backward (e.g. a conv's weight). Whatever the unit
    returned (a dataclass, a namedtuple) and wherever the loss got its tensors (an intermediate
    kept on ``self``), a backward node that needs those weights unpacks them first; unpacking
    gathers the owning unit then. Output hooks still start gathers earlier where they can.
    """
    owners = state.full_owners
    # Compose with hooks already active (activation checkpointing's): every tensor still goes
    # through them, so checkpointing keeps storing and recomputing exactly what it expects.
    outer = current_saved_tensors_hooks()
    outer_pack, outer_unpack = outer if outer is not None else (_identity, _identity)

    def pack(tensor):
        # The modules hold views of ``handle.full`` (views of views keep it as ``_base``).
        unit = owners.get(id(tensor._base)) if tensor._base is not None else None
        packed = outer_pack(tensor)
        return packed if unit is None else SavedWeightView(unit, packed)

    def unpack(saved):
        if isinstance(saved, SavedWeightView):
            saved.unit._gather_for_backward()  # before a recomputation reads the weights, too
            saved = saved.tensor
        return outer_unpack(saved)

    if not saved_tensors_hooks_enabled():  # disabled by the caller
        return contextlib.nullcontext()
    return torch.autograd.graph.saved_tensors_hooks(pack, unpack)


def _identity(x):
    return x
