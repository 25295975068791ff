"""The engine's communication: its process groups, its collectives and bounded waits on them.

**Groups.** A sharded model's ranks are one :class:`ShardGroups`, built once: the shard group (the
ranks that split one copy of the state between them) and, for hybrid sharding (PyTorch FSDP's
``HYBRID_SHARD``, FSDP2's 2-D mesh ``(replicate, shard)``), the replica group (the ranks holding
the same shards in the other shard groups). With world W and shard group size k there are W / k
groups; rank r is position ``r % k`` of group ``r // k``::

    W = 8, k = 4:   shard groups    (0, 1, 2, 3) (4, 5, 6, 7)
                    replica groups  (0, 4) (1, 5) (2, 6) (3, 7)

Per step and unit the all-gathers and the reduce-scatter stay inside the shard group (the fast
links of a node); one all-reduce of the n/k-element shard gradient runs over the replica group.
The rank arithmetic is pure (tested over many world sizes).

**Reduction groups.** Collectives of one process group run in issue order, so a backward prefetch
issued after a gradient reduction would wait for it; reductions run on a second group over the
same ranks. ``new_group`` must be called by every rank of the world, in the same order, for every
group, so :func:`create_reduction_groups` all-gathers every rank's groups first.

**Waits.** Every asynchronous collective of a training step is waited on through
:func:`wait_within`: a rank whose peers never issue the collective (ranks that ran different
units) fails after the timeout, naming what it waited for, instead of hanging.
"""

import datetime
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

Ranks = Tuple[int, ...]
DEFAULT_COLLECTIVE_TIMEOUT = datetime.timedelta(minutes=5)


@dataclass(frozen=True)
class ShardGroups:
    """The process groups of one sharded model: ``shard`` splits the state (default: the
    world), ``replica`` (hybrid sharding) holds the same shards in the other shard groups."""

    shard: Any = None
    replica: Any = None

    def __post_init__(self):
        if self.shard is None:
            object.__setattr__(self, "shard", dist.group.WORLD)
        if self.replica is not None and dist.get_rank(self.replica) < 0:
            raise ValueError("the replica group must contain this rank (the ranks holding its shards)")

    @property
    def size(self) -> int:
        """Ranks of the shard group (the shards of one flat parameter)."""
        return dist.get_world_size(self.shard)

    @property
    def rank(self) -> int:
        return dist.get_rank(self.shard)

    @property
    def replicas(self) -> int:
        return dist.get_world_size(self.replica) if self.replica is not None else 1

    @property
    def replica_rank(self) -> int:
        """This rank's position in its replica group (0: the first replica)."""
        return dist.get_rank(self.replica) if self.replica is not None else 0

    def data_parallel(self) -> list:
        """The shard group, then the replica group: what must agree over the whole world goes
        through both (the replica group's first rank belongs to the first shard group, so two
        broadcasts carry the world's first rank's values)."""
        return [self.shard] + ([self.replica] if self.replica is not None else [])


# -- hybrid sharding's rank arithmetic ------------------------------------------------------------
def shard_group_size_problem(world_size: int, shard_group_size: int) -> Optional[str]:
    """Why ``shard_group_size`` cannot split ``world_size`` ranks (None when it can)."""
    if shard_group_size < 0:
        return f"must be 0 (shard over all ranks) or a group size > 0, got {shard_group_size}"
    if shard_group_size > 0 and world_size % shard_group_size != 0:
        return (
            f"({shard_group_size}) must divide the world size ({world_size}); use a divisor such as "
            f"the ranks per node, or 0 to shard over all ranks"
        )
    return None


def _checked_size(world_size: int, shard_group_size: int) -> int:
    problem = shard_group_size_problem(world_size, shard_group_size)
    if problem is not None:
        raise ValueError(f"shard_group_size {problem}")
    return shard_group_size or world_size


def shard_group_ranks(world_size: int, shard_group_size: int) -> List[Ranks]:
    """Ranks of each shard group: k consecutive ranks; 0 means one group of all ranks.

    e.g. (6, 3) -> [(0, 1, 2), (3, 4, 5)]. ValueError when k does not divide the world.
    """
    k = _checked_size(world_size, shard_group_size)
    return [tuple(range(start, start + k)) for start in range(0, world_size, k)]


def replica_group_ranks(world_size: int, shard_group_size: int) -> List[Ranks]:
    """Ranks of each replica group: the ranks at the same position of every shard group.

    e.g. (6, 3) -> [(0, 3), (1, 4), (2, 5)]; (4, 0) -> [(0,), (1,), (2,), (3,)] (one replica).
    """
    k = _checked_size(world_size, shard_group_size)
    return [tuple(range(position, world_size, k)) for position in range(k)]


def hybrid_groups(shard_group_size: int) -> ShardGroups:
    """This rank's :class:`ShardGroups` for shard groups of ``shard_group_size`` consecutive
    ranks. Collective: every rank calls it. 0 (or the world size) is full sharding (the world,
    no replicas); otherwise every rank creates every shard group and then every replica group, in
    that order, and keeps its own."""
    world, rank = dist.get_world_size(), dist.get_rank()
    shards = shard_group_ranks(world, shard_group_size)
    if len(shards) == 1:
        return ShardGroups(dist.group.WORLD)
    mine = [None, None]
    for kind, layout in enumerate((shards, replica_group_ranks(world, shard_group_size))):
        for ranks in layout:
            group = dist.new_group(list(ranks))  # every rank, members or not
            if rank in ranks:
                mine[kind] = group
    return ShardGroups(mine[0], mine[1])


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


# -- the collectives of a flat parameter ---------------------------------------------------------
def _is_gloo(group) -> bool:
    return dist.get_backend(group) == "gloo"


class _Done:
    """A finished collective (of a group of one rank: nothing to exchange)."""

    def wait(self, timeout=None) -> bool:
        return True


def gather_into(output: torch.Tensor, shard: torch.Tensor, group, async_op: bool):
    """All-gather equal shards into ``output`` (world_size * shard.numel(),)."""
    if dist.get_world_size(group) == 1:  # replicated: a copy, without a trip through the backend
        output.copy_(shard)
        return _Done() if async_op else None
    if _is_gloo(group):
        # gloo's list all-gather into views of ``output`` is ~1.5x faster than its
        # all_gather_into_tensor, which stages through a temporary (measured, torch 2.14).
        return dist.all_gather(
            list(output.chunk(dist.get_world_size(group))), shard, group=group, async_op=async_op
        )
    return dist.all_gather_into_tensor(output, shard, group=group, async_op=async_op)


def reduce_scatter_into(full: torch.Tensor, lo: int, hi: int, group):
    """Sum ``full`` over ranks and return (work, this rank's reduced slice [lo, hi)).

    The slice is valid once ``work`` is waited on. gloo has no native reduce-scatter (torch
    emulates it, ~2x slower than its all-reduce here), so on gloo the full vector is all-reduced
    in place and the slice is a view of it, copied out when the reduction is finished, so the
    full buffer dies with the reduction (one unit's backward later).
    """
    if dist.get_world_size(group) == 1:
        return _Done(), full[lo:hi]
    if _is_gloo(group):
        return dist.all_reduce(full, group=group, async_op=True), full[lo:hi]
    out = torch.empty(hi - lo, dtype=full.dtype, device=full.device)
    return dist.reduce_scatter_tensor(out, full, group=group, async_op=True), out


# -- bounded waits --------------------------------------------------------------------------------
class CollectiveTimeout(RuntimeError):
    """A collective of the sharded engine did not complete within its timeout on this rank."""


class CollectiveError(RuntimeError):
    """A collective of the sharded engine failed on this rank for another reason (a peer that
    died or closed its connection, a transport error)."""


def as_timedelta(timeout) -> datetime.timedelta:
    """Seconds (int/float) or a timedelta; must be positive."""
    if not isinstance(timeout, datetime.timedelta):
        timeout = datetime.timedelta(seconds=float(timeout))
    if timeout.total_seconds() <= 0:
        raise ValueError(f"collective_timeout must be positive, got {timeout}")
    return timeout


def wait_within(work, timeout: datetime.timedelta, what, device: torch.device) -> None:
    """``work.wait()`` that raises ``CollectiveTimeout`` naming ``what`` (a string, or a function
    giving one, called only on failure) after ``timeout``, and ``CollectiveError`` naming it when
    the collective fails otherwise.

    On CUDA a wait with a timeout would block the CPU until the collective ends (NCCL polls),
    losing the overlap of communication and compute; there the wait stays stream-ordered and
    torch's NCCL watchdog bounds a hang by the process group's own timeout (10 minutes unless
    ``init_process_group(timeout=...)`` says otherwise).
    """
    try:
        if device.type == "cpu":
            work.wait(timeout=timeout)
        else:
            work.wait()
    except RuntimeError as error:
        described = what() if callable(what) else what
        if not is_timeout(error):
            raise CollectiveError(
                f"FullyShardedDataParallel: {described} failed on this rank: {error}"
            ) from error
        raise CollectiveTimeout(
            f"FullyShardedDataParallel: {described} did not complete within {timeout.total_seconds():g} s "
            f"on this rank ({error}). Ranks probably ran different units: a branch taken on some "
            "ranks only cannot be sharded; an output unused on some ranks needs "
            "find_unused_parameters=True"
        ) from error


def is_timeout(error: RuntimeError) -> bool:
    """Whether a failed wait timed out (gloo: "Operation timed out!", "Timed out waiting ...")
    rather than failed (a peer's connection reset or closed)."""
    return "timed out" in str(error).lower()
