"""One sharded unit's runtime state and every change to it (as FSDP2's ``FSDPParamGroup``).

A ``UnitState`` owns the unit's flat-parameter handles and its :class:`~vistrain.fsdp.phases.Phase`.
Per training step::

    begin_forward:  all-gather the shards (prefetch the next unit's)     IDLE -> FORWARD
    end_forward:    free the full weights (ZeRO-3), hook the outputs     FORWARD -> IDLE
    pre_backward:   gather again (output hook or saved-weight unpack)    IDLE -> BACKWARD
    post_backward:  per handle, once autograd accumulated its gradient: free the full weights,
                    hand the gradient to the model's reductions
    end_backward:   free whatever is still gathered                      BACKWARD -> IDLE

``summoned`` and ``local`` are the two blocks outside training (full parameters, local state
dicts); ``recover`` returns to IDLE after an exception. Every phase change goes through
``_enter``. What units share (reductions, order, gathered bytes) is the ``ModelState`` the
root attaches at its first forward.
"""

import contextlib
import functools
import weakref
from typing import List, Optional

import torch

from vistrain.fsdp.flat_param import FlatParamHandle
from vistrain.fsdp.phases import UNIT_TRANSITIONS, Phase, checked_transition
from vistrain.fsdp.tree import iter_tensors


class UnitState:
    """Handles, phase and transitions of one unit.

    Args:
        handles: the unit's flat parameters (one per parameter group key).
        reshard_after_forward: free the gathered weights after forward (ZeRO-3).
        keep_gathered_for_backward: the unit's weights stay gathered from forward to the end of
            backward (no reshard after forward: the root, ZeRO-2, ``find_unused_parameters``).
        prefetch_depth: units whose gather starts ahead of the one running.
    """

    def __init__(self, handles: List[FlatParamHandle], keep_gathered_for_backward: bool, prefetch_depth: int):
        self.handles = handles
        self.keep_gathered_for_backward = keep_gathered_for_backward
        self.prefetch_depth = prefetch_depth
        self.phase = Phase.IDLE
        self.model = None  # the ModelState, attached by the root's first forward
        self.index = -1  # position in the model's units, outermost first
        self.is_root = False
        self_ref = weakref.ref(self)  # the gradient hooks must not keep the unit alive
        for handle in handles:
            if handle.shard.requires_grad:
                handle.full.register_post_accumulate_grad_hook(
                    functools.partial(_post_accumulate_grad, self_ref, handle)
                )

    def attach(self, model, index: int, is_root: bool) -> None:
        """Join ``model`` (a ModelState) as its unit ``index``."""
        self.model, self.index, self.is_root = model, index, is_root

    def _enter(self, phase: Phase, recovering: bool = False) -> None:
        self.phase = checked_transition(UNIT_TRANSITIONS, self.phase, phase, self.describe(), recovering)

    def describe(self) -> str:
        if self.model is not None:
            return f"unit '{self.model.order.names[self.index]}'"
        return f"unit of {self.handles[0].describe()}" if self.handles else "unit without parameters"

    # -- gathering ------------------------------------------------------------------------------
    def unshard(self) -> None:
        for handle in self.handles:
            self.model.gathered.add(handle.start_unshard())
        for handle in self.handles:
            self.model.gathered.add(handle.wait_unshard())

    def reshard(self) -> None:
        for handle in self.handles:
            self._reshard_handle(handle)

    def _reshard_handle(self, handle: FlatParamHandle) -> None:
        self.model.gathered_freed(handle.reshard())

    def prefetch(self, for_backward: bool) -> None:
        """Start this unit's gathers ahead of its turn (not again once its backward began)."""
        if for_backward and self.phase is Phase.BACKWARD:
            return
        for handle in self.handles:
            self.model.gathered.add(handle.start_unshard())

    def _prefetch_neighbours(self, step: int) -> None:
        for index in self.model.order.neighbours(self.index, step, self.prefetch_depth):
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
        if training:
            self._prefetch_neighbours(+1)
        return training

    def end_forward(self, outputs, training: bool):
        """After the wrapped module ran: free or keep the weights, hook the outputs' backward."""
        model = self.model
        grad_enabled = torch.is_grad_enabled()
        keep = self.keep_gathered_for_backward or self.is_root
        if model.phase is not Phase.BACKWARD and (not grad_enabled or not keep):
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

    @contextlib.contextmanager
    def local(self):
        """state_dict()/load_state_dict() deal in this rank's shards inside the block."""
        self._enter(Phase.LOCAL)
        try:
            yield
        finally:
            self._enter(Phase.IDLE)


def _post_accumulate_grad(unit_ref, handle: FlatParamHandle, _full: torch.Tensor) -> None:
    unit: Optional[UnitState] = unit_ref()
    grad = handle.take_full_grad()
    if unit is not None and grad is not None:
        unit.post_backward(handle, grad)
