"""Hybrid sharding: shard within groups of k consecutive ranks (a node), replicate across them.

PyTorch FSDP's ``HYBRID_SHARD`` (FSDP2: a 2-D mesh ``(replicate, shard)``). With world W and
shard group size k there are R = W / k groups; rank r is position ``r % k`` of group ``r // k``::

    W = 8, k = 4:   shard groups    (0, 1, 2, 3) (4, 5, 6, 7)
                    replica groups  (0, 4) (1, 5) (2, 6) (3, 7)

The ranks of a replica group hold the same shard of every flat parameter. Per step and unit the
all-gathers and the reduce-scatter stay inside the shard group (the fast links of a node); only
one all-reduce of the n/k-element shard gradient runs over the replica group (across nodes).
Gradients are averaged over all W ranks, so training equals DDP over the world.

The rank arithmetic is pure (tested over many world sizes); :func:`hybrid_groups` creates the
process groups, every group on every rank in one order (``new_group``'s contract).
"""

from typing import List, Optional, Tuple

import torch.distributed as dist

Ranks = Tuple[int, ...]


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


def hybrid_groups(shard_group_size: int):
    """This rank's (shard group, replica group or None). Collective: every rank calls it.

    0 (or the world size) is full sharding: (WORLD, None). Otherwise every rank creates every
    shard group and then every replica group, in that order, and keeps its own.
    """
    world, rank = dist.get_world_size(), dist.get_rank()
    shards = shard_group_ranks(world, shard_group_size)
    if len(shards) == 1:
        return dist.group.WORLD, None
    mine = [None, None]
    for kind, layout in enumerate((shards, replica_group_ranks(world, shard_group_size))):
        for ranks in layout:
            group = dist.new_group(list(ranks))  # every rank, members or not
            if rank in ranks:
                mine[kind] = group
    return mine[0], mine[1]
