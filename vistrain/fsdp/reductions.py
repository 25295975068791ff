"""Gradient reductions of one wrapped model: the ones in flight, deferred, and finished.

Reductions run on reduction groups of their own (``collectives.create_reduction_groups``), so
they overlap the gathers and the next unit's backward. With replica groups a reduction has two
stages, each on its own group, each overlapping the next unit's backward: the reduce-scatter
inside the shard group, then the all-reduce of the shard over the replica group. A handle's
``shard.grad`` is final (``on_shard_grad_ready``) only after both.
"""

import functools
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from vistrain.fsdp.collectives import Ranks, group_ranks, wait_within
from vistrain.fsdp.flat_param import FlatParamHandle


class UsedFlags:
    """Which original parameters of ``handle`` got a gradient on any rank: this rank's flags,
    MAX all-reduced (asynchronously, beside the gradient's reduction) over each group the
    gradient is reduced over. A handle of one parameter needs no collective: its reduction runs
    on every rank only once its gradient arrived, so that parameter was used."""

    def __init__(self, handle: FlatParamHandle, used: List[bool], device: torch.device):
        self.handle = handle
        # a gradient arrived, so something was used: no flag at all means the split's hook did
        # not see this backward (counted as all used, never as a silently dropped gradient)
        used = used if any(used) else [True] * len(used)
        self.local = used
        self.flags = torch.tensor(used, dtype=torch.uint8, device=device) if len(used) > 1 else None
        self.work = None

    def start(self, group) -> None:
        self.wait()
        if self.flags is not None and dist.get_world_size(group) > 1:
            self.work = dist.all_reduce(self.flags, op=dist.ReduceOp.MAX, group=group, async_op=True)

    def wait(self) -> None:
        if self.work is not None:
            work, self.work = self.work, None
            what = f"the used-parameter flags of {self.handle.describe()}"
            wait_within(work, self.handle.timeout, what, self.flags.device)

    def without_grad(self) -> Tuple[int, ...]:
        self.wait()
        used = self.flags.tolist() if self.flags is not None else [True] * len(self.local)
        return tuple(i for i, u in enumerate(used) if not u)


@dataclass
class PendingReduction:
    """A gradient reduction started in backward; its result is added to the shard's ``.grad``
    once every rank has issued it (``work`` waited when the next reduction starts, or at the end
    of backward)."""

    handle: FlatParamHandle
    work: dist.Work
    reduced: torch.Tensor  # (shard_numel,) this rank's slice of the averaged gradient
    source: torch.Tensor  # (padded_numel,) the full gradient being reduced; alive until the wait
    without_grad: Tuple[int, ...] = ()  # origins no rank gave a gradient (find_unused_parameters)
    used: Optional[UsedFlags] = None  # the ranks' agreement on ``without_grad``, in flight
    pending: Tuple[int, ...] = ()  # origins this rank gave none, settled at the end of backward


class ReductionQueue:
    """The model's gradient reductions: in flight, deferred to the end of backward, finished."""

    def __init__(self, reduction_groups: Dict[Ranks, object], on_freed: Callable[[int], None]):
        self.reduction_groups = reduction_groups
        self.on_freed = on_freed  # told the bytes of each full gradient dropped (the heap release)
        # called with each handle whose shard gradient is final for this backward (the optimizer
        # step in backward); None: gradients wait in ``shard.grad`` for ``optimizer.step()``
        self.on_shard_grad_ready: Optional[Callable[[FlatParamHandle], None]] = None
        self.pending: List[PendingReduction] = []  # reduce-scatters in flight
        self.across: List[PendingReduction] = []  # cross-replica all-reduces in flight (hybrid)
        # find_unused_parameters: full gradients kept until the end of backward, by handle.
        self.deferred: Dict[FlatParamHandle, torch.Tensor] = {}
        # this backward's per-origin "got a gradient here" flags of the handles of several
        # parameters, agreed on once at its end (``agree_on_used``)
        self.local_used: Dict[FlatParamHandle, List[bool]] = {}

    def start(
        self, handle: FlatParamHandle, grad: torch.Tensor, without_grad: Optional[Tuple[int, ...]] = None
    ) -> None:
        """Start reducing ``handle``'s full gradient; ``without_grad``: the origins no rank gave a
        gradient when the ranks agreed already (find_unused_parameters), else agreed here."""
        # The previous reduction had this handle's whole backward to overlap with; moving it on now
        # bounds the full-size gradient buffers alive at any time to this one's and one in flight
        # (gloo reduces the full vector in place: its buffer lives until the reduce-scatter is
        # waited); a cross-replica all-reduce holds only a shard.
        self._advance()
        used, pending = None, ()
        if without_grad is None:
            used, pending = self._used_flags(handle, grad.device)
            without_grad = ()
        if handle.world_size == 1 and handle.groups.replica is not None:
            # replicated (shard groups of one rank): the gradient is the shard; one all-reduce over
            # the replicas, started now, as DDP's buckets (no reduce-scatter over one rank first)
            group = self.reduction_groups[group_ranks(handle.groups.replica)]
            work, reduced = handle.start_replicated_all_reduce(grad, group)
            if used is not None:
                used.start(group)
            self.across.append(PendingReduction(handle, work, reduced, reduced, without_grad, used, pending))
            return
        group = self.reduction_groups[group_ranks(handle.groups.shard)]
        work, reduced, source = handle.start_reduce_scatter(grad, group)
        if used is not None:
            used.start(group)
        self.pending.append(PendingReduction(handle, work, reduced, source, without_grad, used, pending))

    def _used_flags(self, handle: FlatParamHandle, device) -> Tuple[Optional[UsedFlags], Tuple[int, ...]]:
        """How the ranks agree on the origins of ``handle`` no rank gave a gradient: with the
        step in backward, flags all-reduced beside this reduction (the step needs them when it
        is final); else kept for one all-reduce at the end of backward (``agree_on_used``),
        the origins this rank gave none ``pending`` until then."""
        local = handle.shard_grad.used_origins()
        if self.on_shard_grad_ready is not None:
            return UsedFlags(handle, local, device), ()
        if len(local) < 2:  # its reduction runs only once its gradient arrived: used
            return None, ()
        local = local if any(local) else [True] * len(local)  # as UsedFlags counts it
        self.local_used[handle] = local
        return None, tuple(i for i, u in enumerate(local) if not u)

    def defer(self, handle: FlatParamHandle, grad: torch.Tensor) -> None:
        self.deferred[handle] = grad

    def finish_all(self, handles: Sequence[FlatParamHandle] = (), groups: Sequence = ()) -> None:
        """Wait for every in-flight reduction and add its result to the local gradients. With
        ``groups`` (a synced backward without the step inside it), the ranks then agree on
        which origins of ``handles`` (the model's, in its order) any of them gave a gradient."""
        flags = self._start_agreement(handles, groups)
        self._advance()
        self._advance()  # the cross-replica all-reduces the first pass started
        if flags is not None:
            self._finish_agreement(flags, groups)

    def _start_agreement(self, handles, groups) -> Optional[Tuple[list, torch.Tensor, object]]:
        """One MAX all-reduce (over ``groups[0]``, asynchronous: it overlaps the last reductions)
        of every multi-parameter handle's per-origin flags, zeros where a handle was not reduced;
        the same length on every rank (DDP's unused-parameter bitmap: one per backward)."""
        local, self.local_used = self.local_used, {}
        handles = [h for h in handles if h.shard.requires_grad and len(h.origins) > 1]
        if not groups or not handles:
            return None
        flat = [u for h in handles for u in local.get(h, [False] * len(h.origins))]
        flags = torch.tensor(flat, dtype=torch.uint8, device=handles[0].compute_device)
        work = None
        if dist.get_world_size(groups[0]) > 1:
            work = dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=groups[0], async_op=True)
        return handles, flags, work

    def _finish_agreement(self, started, groups) -> None:
        """Wait for the flags (then over the replica group), hand the pending origins over."""
        handles, flags, work = started
        what, timeout = "the used-parameter flags", handles[0].timeout
        if work is not None:
            wait_within(work, timeout, what, flags.device)
        for group in groups[1:]:
            if dist.get_world_size(group) > 1:
                work = dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=group, async_op=True)
                wait_within(work, timeout, what, flags.device)
        used, at = flags.tolist(), 0
        for handle in handles:
            handle.shard_grad.add_pending(used[at : at + len(handle.origins)])
            at += len(handle.origins)

    def _advance(self) -> None:
        """Move every reduction in flight one stage on: cross-replica all-reduces finish;
        reduce-scatters finish, or start their all-reduce over the replica group (hybrid)."""
        across, self.across = self.across, []
        for reduction in across:
            self._wait(reduction, _replica_description)
            self._finish(reduction)
        pending, self.pending = self.pending, []
        for reduction in pending:
            self._wait(reduction, _reduction_description)
            self.on_freed(reduction.source.untyped_storage().nbytes())  # the full gradient, now dropped
            handle = reduction.handle
            if handle.groups.replica is None:
                self._finish(reduction)
                continue
            group = self.reduction_groups[group_ranks(handle.groups.replica)]
            work, shard = handle.start_replica_all_reduce(reduction.reduced, group)
            if reduction.used is not None:
                reduction.used.start(group)
            self.across.append(
                PendingReduction(
                    handle, work, shard, shard, reduction.without_grad, reduction.used, reduction.pending
                )
            )

    @staticmethod
    def _wait(reduction: PendingReduction, describe: Callable[[FlatParamHandle], str]) -> None:
        wait_within(
            reduction.work,
            reduction.handle.timeout,
            functools.partial(describe, reduction.handle),
            reduction.source.device,
        )

    def _finish(self, reduction: PendingReduction) -> None:
        """The shard gradient is averaged over the whole world: add it, announce it."""
        without_grad = reduction.without_grad
        if reduction.used is not None:
            without_grad = reduction.used.without_grad()
        reduction.handle.shard_grad.add_reduced(reduction.reduced, without_grad, reduction.pending)
        if self.on_shard_grad_ready is not None:
            self.on_shard_grad_ready(reduction.handle)

    def discard(self) -> None:
        """After an interrupted step: wait for what was issued (so every rank can reset on its
        own) and drop the results."""
        for reduction in self.pending + self.across:
            self._wait(reduction, _discarded_description)
            if reduction.used is not None:
                reduction.used.wait()
        self.pending.clear()
        self.across.clear()
        self.deferred.clear()
        self.local_used.clear()

    def reduce_deferred(self, handles: List[FlatParamHandle], groups: Sequence) -> None:
        """find_unused_parameters: reduce, in the canonical unit order, every handle some rank used.

        A MAX all-reduce of per-handle "has a gradient here" flags and per-origin "got a
        gradient here" flags (over the shard group, then the replica group: ``groups``) tells
        every rank which handles to reduce, and inside them which original parameters no rank
        used; a rank that did not use a handle contributes zeros. Handles no rank used keep
        ``.grad`` as it was, as DDP leaves globally unused parameters; origins no rank used are
        recorded with the shard gradient (the optimizer step leaves them alone).
        """
        handles = [h for h in handles if h.shard.requires_grad]
        local = [h in self.deferred or h.shard_grad.accumulated() is not None for h in handles]
        origins = [used for h in handles for used in h.shard_grad.used_origins()]
        device = handles[0].compute_device if handles else torch.device("cpu")
        flags = torch.tensor(local + origins, dtype=torch.uint8, device=device)
        for group in groups:
            if not handles or dist.get_world_size(group) == 1:
                continue
            work = dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=group, async_op=True)
            wait_within(
                work, handles[0].timeout, "the used-parameter flags of find_unused_parameters", flags.device
            )
        flags = flags.tolist()
        used_origins = flags[len(handles) :]
        for handle, used in zip(handles, flags):
            origin_flags, used_origins = (
                used_origins[: len(handle.origins)],
                used_origins[len(handle.origins) :],
            )
            if used:
                grad = self.deferred.pop(handle, None)
                if grad is None:
                    grad = torch.zeros_like(handle.full, dtype=handle.compute_dtype).detach()
                self.start(handle, grad, tuple(i for i, u in enumerate(origin_flags) if not u))
        self.deferred.clear()

    def tensors(self):
        """Every tensor the queue keeps alive (memory accounting)."""
        for reduction in self.pending + self.across:
            yield reduction.reduced
            yield reduction.source
        yield from self.deferred.values()


def _reduction_description(handle: FlatParamHandle) -> str:
    return f"the gradient reduction of {handle.describe()}"


def _discarded_description(handle: FlatParamHandle) -> str:
    return f"a discarded gradient reduction of {handle.describe()}"


def _replica_description(handle: FlatParamHandle) -> str:
    return f"the cross-replica gradient all-reduce of {handle.describe()}"
