"""What the units of one wrapped model share, owned by one ``ModelState`` built at the root's
first forward: the options of the whole model (:class:`RootOptions`, given to the root), its
phase, its reduction groups and in-flight reductions, the units' execution order and first-step
check, the buffer broadcasts and the release of freed heap pages.

The model moves through :class:`~vistrain.fsdp.unit.Phase`::

    IDLE --root forward--> FORWARD --root forward returns--> IDLE   (units may stay gathered)
    IDLE --first backward hook of the step--> BACKWARD --autograd's final callback--> IDLE

An exception can leave it in FORWARD or BACKWARD (autograd drops the queued final callback
when backward raises). The next root forward, ``state_dict()``, ``summon_full_params()`` or an
explicit ``reset_iter_state()`` then waits for and discards the aborted step's reductions,
frees every gathered weight and returns to IDLE with a warning. The aborted accumulation
group's gradients are dropped: the ``no_sync()`` micro-batches' and every gradient the group
created, so training goes on as if the step had been skipped (what it added to older gradients
stays there, as in DDP's ``.grad``, until ``zero_grad()``). With the step in
backward, units that already stepped cannot be undone: the reset then raises
:class:`~vistrain.fsdp.grads.PartialStepError` naming them.
"""

import contextlib
import ctypes
import datetime
import platform
import warnings
from dataclasses import dataclass
from typing import List, Optional, Union

import torch
import torch.distributed as dist

from vistrain.fsdp.collectives import (
    DEFAULT_COLLECTIVE_TIMEOUT,
    ShardGroups,
    as_timedelta,
    create_reduction_groups,
    wait_within,
)
from vistrain.fsdp.flat_param import FlatParamHandle
from vistrain.fsdp.grads import OptimizerInBackward, PartialStepError
from vistrain.fsdp.ownership import owned_modules
from vistrain.fsdp.reductions import ReductionQueue
from vistrain.fsdp.unit import MODEL_TRANSITIONS, Phase, UnitState, checked_transition
from vistrain.fsdp.unit_order import UnitOrder
from vistrain.torch_compat import (
    backward_running,
    current_saved_tensors_hooks,
    queue_autograd_callback,
    saved_tensors_hooks_enabled,
    view_base,
)


@dataclass(frozen=True)
class RootOptions:
    """Options of the whole wrapped model, given to its root unit (``root=``).

    broadcast_buffers: before each training forward, copy the first rank's buffers to every rank
        (DDP's default), so BatchNorm statistics and ``state_dict()`` agree.
    find_unused_parameters: allow units whose outputs do not reach the loss on some ranks (as
        DDP's option): weights stay gathered until the end of backward (ZeRO-2) and gradients are
        reduced at its end, after agreeing which units any rank produced a gradient for. Without
        it, a unit must get a gradient on every rank or on none; an original parameter no rank
        gave a gradient keeps ``.grad`` as it was either way (``shard_grad.py``).
    collective_timeout: seconds (or a timedelta) after which a waited collective of a training
        step raises instead of hanging (ranks that ran different units). Default 5 minutes.
    release_host_memory: on CPU, give free heap pages back to the OS at unit boundaries once
        enough gathered weights and gradients were freed (glibc ``malloc_trim``).
    prefetch_depth: how many of the next units (in the first step's execution order) a unit
        starts gathering when it runs, forward and backward: 0 gathers each unit only when it
        runs; each step of depth keeps one more unit's full weights alive.
    """

    broadcast_buffers: bool = True
    find_unused_parameters: bool = False
    collective_timeout: Union[float, datetime.timedelta] = DEFAULT_COLLECTIVE_TIMEOUT
    release_host_memory: bool = True
    prefetch_depth: int = 1

    def __post_init__(self):
        object.__setattr__(self, "collective_timeout", as_timedelta(self.collective_timeout))
        if self.prefetch_depth < 0:
            raise ValueError(f"prefetch_depth must be >= 0, got {self.prefetch_depth}")


class ModelState:
    """Shared state of one wrapped model; ``units`` outermost first (the canonical order of
    reductions and checks), ``names`` their paths from the root ("<root>" for the root), and
    ``modules[i]`` the module unit ``i`` wraps (its buffers are broadcast). ``groups`` and
    ``device`` are the root's."""

    def __init__(
        self,
        options: RootOptions,
        groups: ShardGroups,
        device: torch.device,
        units: List[UnitState],
        names: List[str],
        modules: list,
    ):
        self.options = options
        self.groups = groups
        self.device = device
        self.units = units
        self.modules = modules
        self.phase = Phase.IDLE
        self.require_grad_sync = True
        self.binding: Optional[OptimizerInBackward] = None  # the optimizer stepping in backward
        self.order = UnitOrder(names, groups.data_parallel(), device, options.collective_timeout)
        self.heap = HeapRelease(options.release_host_memory and device.type == "cpu")
        handle_groups = [g for unit in units for h in unit.handles for g in h.groups.data_parallel()]
        self.reductions = ReductionQueue(
            create_reduction_groups(handle_groups or groups.data_parallel()), self.heap.freed
        )
        # The gathers get groups of their own too: what the user runs on the shard group (sync
        # BatchNorm's all-reduces, a loss's all-gather) must not queue behind a prefetched
        # unit's megabytes on the same connections (dev/nodes/diagnose_two_hosts.py measured it).
        shard_groups = [h.groups.shard for unit in units for h in unit.handles] or [groups.shard]
        self.gather_groups = create_reduction_groups(shard_groups)
        # id(handle.full) -> unit: the tensors whose views the modules compute with.
        self.full_owners = {id(h.full): unit for unit in units for h in unit.handles}
        for index, unit in enumerate(units):
            unit.attach(self, index, is_root=index == 0)

    def _enter(self, phase: Phase, recovering: bool = False) -> None:
        self.phase = checked_transition(MODEL_TRANSITIONS, self.phase, phase, "the wrapped model", recovering)

    def handles(self) -> List[FlatParamHandle]:
        return [h for unit in self.units for h in unit.handles]

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
            for group in self.groups.data_parallel():
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
            if self.binding is not None:
                self.binding.stepped.clear()
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
            self.reductions.reduce_deferred(self.handles(), self.groups.data_parallel())
        agree = self.require_grad_sync and self.binding is None and not self.options.find_unused_parameters
        self.reductions.finish_all(self.handles(), self.groups.data_parallel() if agree else ())
        for unit in self.units:
            unit.end_backward()
        if self.require_grad_sync:
            for handle in self.handles():
                handle.shard_grad.end_step()
        if self.binding is not None:
            self.binding.stepped.clear()
        self.heap.at_unit_boundary()
        self._enter(Phase.IDLE)

    def step_in_backward(self, binding: Optional[OptimizerInBackward]) -> None:
        """Have ``binding`` step each handle's shard once its gradient is final (None: stop).
        One optimizer steps the whole model: binding a second one is refused."""
        bound = self.binding
        if binding is not None and bound is not None and bound.optimizer is not binding.optimizer:
            raise ValueError(
                "apply_optimizer_in_backward: another optimizer is already bound to this model (a "
                "second one would replace it, and the first would train nothing): bind one optimizer "
                "over model.parameters(), with param groups for different settings"
            )
        self.binding = binding
        self.reductions.on_shard_grad_ready = binding.step_shard if binding is not None else None

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
        stepped = self.binding.stepped if self.binding is not None else []
        if stepped:
            names = [self.order.names[u.index] for u in self.units if any(h in stepped for h in u.handles)]
            stepped.clear()
            raise PartialStepError(names)

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


# -- DDP's broadcast_buffers ----------------------------------------------------------------------
# DDP's ``broadcast_buffers``: every rank starts each training forward from rank 0's buffers.
#
# Without synchronised BatchNorm each rank updates its running statistics from its own batch, so
# ``state_dict()`` and evaluation would depend on the rank. DDP copies the first rank's buffers to
# every rank before each training forward; the root unit does the same for every unit's buffers.


def model_buffers(wrapped_modules) -> List[torch.Tensor]:
    """Every buffer of the modules the units wrap (not inside nested units), each once, in a
    fixed order."""
    seen, out = set(), []
    for module in wrapped_modules:
        for sub in owned_modules(module):
            for _, buf in sub.named_buffers(recurse=False):
                if id(buf) not in seen:
                    seen.add(id(buf))
                    out.append(buf)
    return out


def broadcast_buffers(wrapped_modules, group, timeout: datetime.timedelta) -> None:
    """Copy the group's first rank's buffers to every rank: one broadcast per (dtype, device)."""
    if dist.get_world_size(group) == 1:
        return
    by_kind = {}
    for buf in model_buffers(wrapped_modules):
        by_kind.setdefault((buf.dtype, buf.device), []).append(buf)
    src = dist.get_global_rank(group, 0)
    for bufs in by_kind.values():
        flat = torch.cat([buf.reshape(-1) for buf in bufs])
        work = dist.broadcast(flat, src=src, group=group, async_op=True)
        wait_within(work, timeout, "the buffer broadcast", flat.device)
        with torch.no_grad():
            for buf, value in zip(bufs, flat.split([buf.numel() for buf in bufs])):
                buf.copy_(value.view_as(buf))


# -- giving freed heap pages back (CPU) -----------------------------------------------------------
# Giving the engine's freed buffers back to the OS on CPU ranks (glibc's ``malloc_trim``).
#
# glibc maps an allocation on its own (and unmaps it when freed) only above its mmap threshold,
# which starts at 128 KiB and grows to the size of each mapped block freed, up to 32 MiB. After
# the first freed layers every block up to 32 MiB comes from the heaps (one arena per thread:
# gloo's threads add theirs), and a heap keeps the pages of freed blocks. A sharded run frees and
# re-allocates gathered weights and full gradients unit after unit, so a rank's resident memory
# grows by hundreds of MiB that no tensor holds. ``malloc_trim(0)`` returns every free page of
# every arena; the engine calls it at unit boundaries once it has freed enough since the last
# call, so its cost (a walk over the arenas' free lists, then the page faults when the pages are
# used again) is paid every few units of a big model and every few steps of a small one. Each unit
# also trims once when it is built: building a unit materialises its parameters and a padded flat
# copy, which otherwise leave the heaps at almost the training peak before the first step. Fixing the threshold instead (``MACHINE.CPU_MMAP_THRESHOLD_MIB``) returns memory at
# every free, at the price of a page fault storm on every large allocation.
# Freed since the last trim: the quick start's model is trimmed every few steps, a big model's
# every unit or two (step-time A/B in docs/notes/memory.md).
TRIM_AFTER_BYTES = 256 * 2**20


def _glibc() -> Optional[ctypes.CDLL]:
    if platform.libc_ver()[0] != "glibc":
        return None
    return ctypes.CDLL("libc.so.6")  # glibc's soname; find_library would spawn ldconfig per call


def release_free_pages() -> None:
    """Return every free heap page to the OS now (glibc; a no-op elsewhere)."""
    libc = _glibc()
    if libc is not None:
        libc.malloc_trim(0)


class HeapRelease:
    """Counts the bytes the engine frees and trims glibc's heaps at the next unit boundary once
    they reach ``TRIM_AFTER_BYTES``. Does nothing when disabled or not on glibc."""

    def __init__(self, enabled: bool):
        self._libc = _glibc() if enabled else None
        self.freed_since_trim = 0

    def freed(self, nbytes: int) -> None:
        self.freed_since_trim += nbytes

    def at_unit_boundary(self) -> None:
        if self._libc is None or self.freed_since_trim < TRIM_AFTER_BYTES:
            return
        self._libc.malloc_trim(0)
        self.freed_since_trim = 0
