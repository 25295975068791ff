"""Bytes each rank sends per training step, by process group: full vs hybrid sharding.

The communication side of the planner (``memory.py`` is the memory side);
``tools/plan_memory.py`` prints :func:`traffic` for every sharded recipe and
``dev/plan_hybrid.py`` the SEER RegNetY-10B case of docs/engine.md (hybrid sharding).
"""

from dataclasses import asdict, dataclass
from typing import Dict, Optional, Sequence

from vistrain.fsdp.collectives import replica_group_ranks, shard_group_ranks
from vistrain.fsdp.flat_param import shard_size
from vistrain.planner.shape import MIB, ModelShapes, RunShape, run_shape, shapes_for


@dataclass
class Traffic:
    """Bytes one rank sends per optimizer step (``update_freq`` 1), by process group."""

    shard_group: float  # all-gathers of the weights and reduce-scatters of the gradients
    replica_group: float  # hybrid: the all-reduce of each shard gradient across the groups
    cross_node: float  # the part sent in collectives whose group spans nodes

    def as_mib(self) -> Dict[str, float]:
        return {k + "_mib": round(v / MIB, 1) for k, v in asdict(self).items()}


def traffic_bytes(
    sizes: Sequence[int], world: int, shard_group_size: int, ranks_per_node: int,
    compute_bytes: int, reduce_bytes: int, reshard: bool,
) -> Traffic:  # fmt: skip
    """Bytes per rank and step, as ring collectives send them (the FSDP paper's accounting).

    With g ranks, an all-gather or reduce-scatter of P elements sends (g - 1) / g * P per rank,
    an all-reduce twice that. Unit u (n_u elements, padded to P_u = ceil(n_u / k) * k) is gathered
    twice under ZeRO-3 (forward and backward; the root once, it stays gathered) and once under
    ZeRO-2, in the compute dtype; its gradient is reduce-scattered over the k ranks of the shard
    group and, with R = W / k replicas, its P_u / k shard all-reduced over the R replicas, in the
    reduce dtype. A group spanning nodes counts whole as cross-node (a ring over it is as fast as
    its slowest hop). Full sharding is k = W.
    """
    k = shard_group_size or world
    replicas = world // k
    gathered = scattered = 0
    for i, n in enumerate(sizes):
        padded = shard_size(n, k) * k
        gathered += padded * (2 if reshard and i != len(sizes) - 1 else 1)  # root last in ``sizes``
        scattered += padded
    inside = (k - 1) / k * (gathered * compute_bytes + scattered * reduce_bytes)
    across = 2 * (replicas - 1) / replicas * (scattered / k) * reduce_bytes
    cross = inside * _spans_nodes(shard_group_ranks(world, k)[0], ranks_per_node)
    cross += across * _spans_nodes(replica_group_ranks(world, k)[0], ranks_per_node)
    return Traffic(inside, across, cross)


def _spans_nodes(ranks: Sequence[int], ranks_per_node: int) -> bool:
    return len({r // ranks_per_node for r in ranks}) > 1


def traffic(cfg, shapes: Optional[ModelShapes] = None) -> Traffic:
    """:func:`traffic_bytes` of a sharded training run of ``cfg`` (its units and groups)."""
    return traffic_of(run_shape(cfg, shapes_for(cfg, shapes)))


def traffic_of(shape: RunShape) -> Traffic:
    """:func:`traffic_bytes` of a :class:`RunShape`."""
    groups, precision = shape.groups, shape.precision
    return traffic_bytes(
        shape.unit_sizes, groups.world, groups.shard_ranks, groups.ranks_per_node,
        precision.compute_bytes, precision.reduce_bytes, shape.reshard_after_forward,
    )  # fmt: skip
