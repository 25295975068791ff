"""What the units of one wrapped model share, owned by one ``ModelState`` built at the root's
first forward: the model's phase, its reduction groups and in-flight reductions, the units'
execution order and first-step check, the gathered-bytes account.

The model moves through :class:`~vistrain.fsdp.phases.Phase`::

    IDLE --root forward--> FORWARD --root forward returns--> IDLE   (units may stay gathered)
    IDLE --first backward hook of the step--> BACKWARD --autograd's final callback--> IDLE

An exception can leave it in FORWARD or BACKWARD (autograd drops the queued final callback
when backward raises). The next root forward, ``state_dict()``, ``summon_full_params()`` or an
explicit ``reset_iter_state()`` then waits for and discards the aborted step's reductions,
frees every gathered weight and returns to IDLE with a warning: the aborted step's gradients
never reach ``.grad``, so training goes on as if the step had been skipped.
"""

import contextlib
import datetime
import warnings
from dataclasses import dataclass
from typing import Callable, List, Optional

import torch

from vistrain.fsdp.agreement import UnitOrder
from vistrain.fsdp.buffers import broadcast_buffers
from vistrain.fsdp.flat_param import FlatParamHandle
from vistrain.fsdp.heap import HeapRelease
from vistrain.fsdp.memory import GatheredBytes
from vistrain.fsdp.phases import MODEL_TRANSITIONS, Phase, checked_transition
from vistrain.fsdp.reductions import ReductionQueue, create_reduction_groups
from vistrain.fsdp.unit_state import UnitState
from vistrain.torch_compat import (
    backward_running,
    current_saved_tensors_hooks,
    queue_autograd_callback,
    saved_tensors_hooks_enabled,
    view_base,
)


@dataclass(frozen=True)
class RootOptions:
    """The root unit's options that apply to the whole model."""

    process_group: object
    compute_device: torch.device
    broadcast_buffers: bool
    find_unused_parameters: bool
    collective_timeout: datetime.timedelta
    release_host_memory: bool  # CPU: trim glibc's heaps at unit boundaries (heap.py)
    replica_group: object = None  # hybrid sharding: the ranks holding the same shards, or None

    def data_parallel_groups(self) -> list:
        """The shard group, then the replica group: buffers, checks and flags that must agree
        over the whole world go through both (the replica group's first rank belongs to the
        first shard group, so two broadcasts carry the world's first rank's values)."""
        return [self.process_group] + ([self.replica_group] if self.replica_group is not None else [])


class ModelState:
    """Shared state of one wrapped model; ``units`` outermost first (the canonical order of
    reductions and checks), ``names`` their paths from the root ("<root>" for the root), and
    ``modules[i]`` the module unit ``i`` wraps (its buffers are broadcast)."""

    def __init__(self, options: RootOptions, units: List[UnitState], names: List[str], modules: list):
        self.options = options
        self.units = units
        self.modules = modules
        self.phase = Phase.IDLE
        self.require_grad_sync = True
        groups = options.data_parallel_groups()
        self.order = UnitOrder(names, groups, options.compute_device, options.collective_timeout)
        self.heap = HeapRelease(options.release_host_memory and options.compute_device.type == "cpu")
        handle_groups = [g for unit in units for h in unit.handles for g in (h.group, h.replica_group)]
        handle_groups = [g for g in handle_groups if g is not None]
        self.reductions = ReductionQueue(create_reduction_groups(handle_groups or groups), self.heap)
        self.gathered = GatheredBytes()
        # id(handle.full) -> unit: the tensors whose views the modules compute with.
        self.full_owners = {id(h.full): unit for unit in units for h in unit.handles}
        for index, unit in enumerate(units):
            unit.attach(self, index, is_root=index == 0)

    def _enter(self, phase: Phase, recovering: bool = False) -> None:
        self.phase = checked_transition(MODEL_TRANSITIONS, self.phase, phase, "the wrapped model", recovering)

    def handles(self) -> List[FlatParamHandle]:
        return [h for unit in self.units for h in unit.handles]

    def gathered_freed(self, nbytes: int) -> None:
        """A unit freed ``nbytes`` of gathered weights."""
        self.gathered.add(-nbytes)
        self.heap.freed(nbytes)

    # -- forward --------------------------------------------------------------------------------
    def begin_forward(self, training: bool) -> None:
        """Reset a step an exception interrupted; for training, enter FORWARD and sync buffers."""
        if self.is_stale():
            self.reset(f"the previous {self.phase.value} did not finish")
        if not training:
            return
        self._enter(Phase.FORWARD)
        self.order.begin_forward()
        if self.options.broadcast_buffers and self.require_grad_sync:
            for group in self.options.data_parallel_groups():
                broadcast_buffers(self.modules, group, self.options.collective_timeout)

    def end_forward(self) -> None:
        self.order.end_forward()
        self._enter(Phase.IDLE)

    # -- backward -------------------------------------------------------------------------------
    def _announces_backward(self) -> bool:
        # find_unused_parameters defers every backward collective to the end; no_sync has none
        return not self.options.find_unused_parameters and self.require_grad_sync

    def mark_backward(self) -> None:
        """First backward hook of a step: enter BACKWARD and have autograd finalize at its end."""
        if self.phase is not Phase.BACKWARD:
            self._enter(Phase.BACKWARD)
            self.order.begin_backward()
            queue_autograd_callback(self.finish_backward)

    def record_backward(self, unit_index: int) -> None:
        if self._announces_backward():
            self.order.record_backward(unit_index)

    def reduce_gradient(self, handle: FlatParamHandle, grad: torch.Tensor) -> None:
        """A handle's full gradient is ready: keep it (no_sync), defer it (find_unused_parameters)
        or start its reduction."""
        if not self.require_grad_sync:
            handle.accumulate_unsharded(grad)
        elif self.options.find_unused_parameters:
            self.reductions.defer(handle, grad)
        else:
            self.reductions.start(handle, grad)

    def finish_backward(self) -> None:
        """Autograd's final callback, once per backward: finish reductions, free everything."""
        self.order.end_backward(announce=self._announces_backward())
        if self.reductions.deferred or (self.options.find_unused_parameters and self.require_grad_sync):
            self.reductions.reduce_deferred(self.handles(), self.options.data_parallel_groups())
        self.reductions.finish_all()
        for unit in self.units:
            unit.end_backward()
        self.heap.at_unit_boundary()
        self._enter(Phase.IDLE)

    def step_in_backward(self, step_shard: Optional[Callable[[FlatParamHandle], None]]) -> None:
        """Call ``step_shard(handle)`` once each handle's shard gradient is final (None: stop)."""
        self.reductions.on_shard_grad_ready = step_shard

    @contextlib.contextmanager
    def no_sync(self):
        """Accumulate gradients locally (no communication) inside the block."""
        previous, self.require_grad_sync = self.require_grad_sync, False
        try:
            yield
        finally:
            self.require_grad_sync = previous

    # -- recovery -------------------------------------------------------------------------------
    def is_stale(self) -> bool:
        """A forward or backward that an exception interrupted (not one still running)."""
        return self.phase is Phase.FORWARD or (self.phase is Phase.BACKWARD and not backward_running())

    def reset(self, why: Optional[str] = None) -> None:
        """Return to IDLE after an interrupted step: wait for its collectives, discard its gradients.

        Only collectives already issued are waited on, so every rank can reset on its own.
        """
        if why is not None:
            warnings.warn(
                f"FullyShardedDataParallel: {why}; the interrupted step's gradients were discarded "
                "and its gathered weights freed",
                stacklevel=4,
            )
        self.reductions.discard()
        for unit in self.units:
            unit.recover()
        self._enter(Phase.IDLE, recovering=True)

    def recover_if_interrupted(self) -> None:
        """Before gathering full parameters (state dicts): reset a stale step, refuse a running one."""
        if self.is_stale():
            self.reset(f"the previous {self.phase.value} did not finish")
        elif self.phase is not Phase.IDLE:
            raise RuntimeError("full parameters cannot be gathered during forward or backward")

    # -- saved weights --------------------------------------------------------------------------
    def saved_weight_hooks(self):
        """Saved-tensor hooks that gather a unit again before autograd reads its saved weights.

        Autograd keeps views of ``full`` for backward (e.g. a conv's weight). Whatever the unit
        returned (a dataclass, a namedtuple) and wherever the loss got its tensors (an
        intermediate kept on ``self``), a backward node that needs those weights unpacks them
        first; unpacking gathers the owning unit then. Output hooks still start gathers earlier.
        """
        if not saved_tensors_hooks_enabled():  # disabled by the caller
            return contextlib.nullcontext()
        owners = self.full_owners
        # Compose with hooks already active (activation checkpointing's): every tensor still goes
        # through them, so checkpointing keeps storing and recomputing exactly what it expects.
        outer = current_saved_tensors_hooks()
        outer_pack, outer_unpack = outer if outer is not None else (_identity, _identity)

        def pack(tensor):
            base = view_base(tensor)  # the modules hold views of ``handle.full``
            unit = owners.get(id(base)) if base is not None else None
            packed = outer_pack(tensor)
            return packed if unit is None else SavedWeightView(unit, packed)

        def unpack(saved):
            if isinstance(saved, SavedWeightView):
                saved.unit.pre_backward()  # before a recomputation reads the weights, too
                saved = saved.tensor
            return outer_unpack(saved)

        return torch.autograd.graph.saved_tensors_hooks(pack, unpack)


class SavedWeightView:
    """What autograd stores instead of a view of a unit's gathered weights."""

    __slots__ = ("unit", "tensor")

    def __init__(self, unit: UnitState, tensor: torch.Tensor):
        self.unit, self.tensor = unit, tensor


def _identity(x):
    return x
