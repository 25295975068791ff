"""Gradient reductions of one wrapped model: their process groups and the ones in flight.

Collectives of one process group run in issue order, so a backward prefetch (all-gather) issued
after a gradient reduction would wait for it. Reductions therefore run on a second group over
the same ranks (their own gloo threads, or their own NCCL communicator and stream), and overlap.

``new_group`` must be called by every rank of the world, in the same order, for every group,
members or not. Ranks that shard over different groups (a group per node, or the subgroups of
the engine-state tests) each know only their own, so :func:`create_reduction_groups` first
all-gathers every rank's list over the world and then creates every group in one sorted order.
Hybrid sharding's replica groups get their second group the same way.

With replica groups a reduction has two stages, each on its own group, each overlapping the next
unit's backward: the reduce-scatter inside the shard group, then the all-reduce of the shard over
the replica group. A handle's ``shard.grad`` is final (``on_shard_grad_ready``) only after both.
"""

import functools
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from vistrain.fsdp.flat_param import FlatParamHandle
from vistrain.fsdp.heap import HeapRelease
from vistrain.fsdp.timeouts import wait_within

Ranks = Tuple[int, ...]


def group_ranks(group) -> Ranks:
    return tuple(dist.get_process_group_ranks(group))


def create_reduction_groups(groups: Sequence) -> Dict[Ranks, object]:
    """A reduction group for each of ``groups`` (this rank's units' groups), keyed by ranks.

    Collective over the whole world: every rank calls it once per wrapped model, at the root's
    first forward. Groups of one rank need no second group and get their own.
    """
    mine = sorted({group_ranks(g) for g in groups})
    everyone = [mine]
    if dist.get_world_size() > 1:
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, mine)
    created = {}
    for ranks in sorted({tuple(r) for lists in everyone for r in lists}):
        if len(ranks) > 1:
            created[ranks] = dist.new_group(list(ranks))  # every rank, members or not
    by_ranks = {group_ranks(g): g for g in groups}
    return {ranks: created.get(ranks, group) for ranks, group in by_ranks.items()}


@dataclass
class PendingReduction:
    """A gradient reduction started in backward; its result is added to the shard's ``.grad``
    once every rank has issued it (``work`` waited when the next reduction starts, or at the end
    of backward)."""

    handle: FlatParamHandle
    work: dist.Work
    reduced: torch.Tensor  # (shard_numel,) this rank's slice of the averaged gradient
    source: torch.Tensor  # (padded_numel,) the full gradient being reduced; alive until the wait


class ReductionQueue:
    """The model's gradient reductions: in flight, deferred to the end of backward, finished."""

    def __init__(self, reduction_groups: Dict[Ranks, object], heap: HeapRelease):
        self.reduction_groups = reduction_groups
        self.heap = heap  # told of the full gradients freed
        # called with each handle whose shard gradient is final for this backward (the optimizer
        # step in backward); None: gradients wait in ``shard.grad`` for ``optimizer.step()``
        self.on_shard_grad_ready: Optional[Callable[[FlatParamHandle], None]] = None
        self.pending: List[PendingReduction] = []  # reduce-scatters in flight
        self.across: List[PendingReduction] = []  # cross-replica all-reduces in flight (hybrid)
        # find_unused_parameters: full gradients kept until the end of backward, by handle.
        self.deferred: Dict[FlatParamHandle, torch.Tensor] = {}

    def start(self, handle: FlatParamHandle, grad: torch.Tensor) -> None:
        # The previous reduction had this handle's whole backward to overlap with; moving it on now
        # bounds the full-size gradient buffers alive at any time to this one's and one in flight
        # (gloo reduces the full vector in place: its buffer lives until the reduce-scatter is
        # waited); a cross-replica all-reduce holds only a shard.
        self._advance()
        group = self.reduction_groups[group_ranks(handle.group)]
        work, reduced, source = handle.start_reduce_scatter(grad, group)
        self.pending.append(PendingReduction(handle, work, reduced, source))

    def defer(self, handle: FlatParamHandle, grad: torch.Tensor) -> None:
        self.deferred[handle] = grad

    def finish_all(self) -> None:
        """Wait for every in-flight reduction and add its result to the shard's gradient."""
        self._advance()
        self._advance()  # the cross-replica all-reduces the first pass started

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
            self.heap.freed(reduction.source.untyped_storage().nbytes())  # the full gradient, now dropped
            handle = reduction.handle
            if handle.replica_group is None:
                self._finish(reduction)
                continue
            group = self.reduction_groups[group_ranks(handle.replica_group)]
            work, shard = handle.start_replica_all_reduce(reduction.reduced, group)
            self.across.append(PendingReduction(handle, work, shard, shard))

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
        reduction.handle.accumulate_shard_grad(reduction.reduced)
        if self.on_shard_grad_ready is not None:
            self.on_shard_grad_ready(reduction.handle)

    def discard(self) -> None:
        """After an interrupted step: wait for what was issued (so every rank can reset on its
        own) and drop the results."""
        for reduction in self.pending + self.across:
            self._wait(reduction, _discarded_description)
        self.pending.clear()
        self.across.clear()
        self.deferred.clear()

    def reduce_deferred(self, handles: List[FlatParamHandle], groups: Sequence) -> None:
        """find_unused_parameters: reduce, in the canonical unit order, every handle some rank used.

        A MAX all-reduce of per-handle "has a gradient here" flags (over the shard group, then
        the replica group: ``groups``) tells every rank which handles to reduce; a rank that did
        not use one contributes zeros. Handles no rank used keep ``.grad`` as it was, as DDP
        leaves globally unused parameters.
        """
        handles = [h for h in handles if h.shard.requires_grad]
        local = [h in self.deferred or h.unsharded_grad_acc is not None for h in handles]
        device = handles[0].compute_device if handles else torch.device("cpu")
        flags = torch.tensor(local, dtype=torch.uint8, device=device)
        for group in groups:
            if not handles or dist.get_world_size(group) == 1:
                continue
            work = dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=group, async_op=True)
            wait_within(
                work, handles[0].timeout, "the used-parameter flags of find_unused_parameters", flags.device
            )
        for handle, used in zip(handles, flags.tolist()):
            if used:
                grad = self.deferred.pop(handle, None)
                if grad is None:
                    grad = torch.zeros_like(handle.full, dtype=handle.compute_dtype).detach()
                self.start(handle, grad)
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
