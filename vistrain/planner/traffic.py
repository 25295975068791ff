"""Bytes a training step sends: per rank by process group, and over each node's link as the
backend's algorithms send them; and the step time that follows at a given link speed.

The communication side of the planner (``memory.py`` is the memory side). ``tools/plan_memory.py``
prints :func:`traffic` for every recipe, ``dev/nodes/plan_hybrid.py`` the SEER RegNetY-10B case of
docs/memory-and-planner.md, ``dev/nodes/bench_two_hosts.py`` it next to link bytes measured between
two hosts.

Every collective of one step (:func:`step_collectives`), for the sharded engine per unit u of
n_u elements padded to P_u = ceil(n_u / k) * k (k ranks per shard group, R = W / k replicas):
its all-gather in the compute dtype over the shard group (twice under ZeRO-3: forward and
backward; the root once, it stays gathered), its gradient reduction in the reduce dtype over the
shard group (on gloo an all-reduce of the whole P_u: gloo has no reduce-scatter; on NCCL a
reduce-scatter) and with replicas the all-reduce of its P_u / k shard over the replica group; for
DDP the all-reduce of its gradient buckets over the world. Both: synchronised BatchNorm's two
all-reduces per layer (forward statistics, backward sums), the buffer broadcasts without it, and
the loss's collectives (the method's own: ``Method.collectives``, e.g. SimCLR's all-gather of the
embeddings and the all-reduce of their gradient). ``collectives.py`` turns each into what every node
sends over its link. Everything is read from the run's :class:`~vistrain.planner.shape.RunShape`.
"""

from dataclasses import asdict, dataclass
from typing import Dict, List, Sequence

from vistrain.distributed.sync_batchnorm import sync_bn_group_ranks
from vistrain.fsdp.collectives import replica_group_ranks, shard_group_ranks
from vistrain.fsdp.flat_param import shard_size
from vistrain.planner.collectives import Collective, busiest_link_bytes, node_link_bytes
from vistrain.planner.knobs import EXACT_KNOBS, speed_cost
from vistrain.planner.shape import MIB, RunShape
from vistrain.torch_compat import BatchNormBase

DDP_BUCKET_BYTES, DDP_FIRST_BUCKET_BYTES = 25 * MIB, 1 * MIB  # DDP's defaults


@dataclass
class Traffic:
    """Bytes per optimizer step (``update_freq`` 1). ``shard_group`` and ``replica_group``: what
    one rank sends in those groups' weight and gradient collectives (ring accounting: an
    all-gather of S over g ranks sends (g - 1) / g * S per rank, an all-reduce twice that);
    ``cross_node``: what the busiest node's link carries, every collective of the step counted as
    the backend sends it, divided by the node's ranks (times the ranks per node it is the link's
    bytes each way)."""

    shard_group: float
    replica_group: float
    cross_node: float

    def as_mib(self) -> Dict[str, float]:
        return {k + "_mib": round(v / MIB, 1) for k, v in asdict(self).items()}


def traffic_bytes(
    sizes: Sequence[int], world: int, shard_group_size: int,
    compute_bytes: int, reduce_bytes: int, reshard: bool,
) -> Dict[str, float]:  # fmt: skip
    """``{"shard_group": ..., "replica_group": ...}``: bytes per rank and step in the shard
    group's all-gathers and reduce-scatters and the replica group's all-reduces (ring accounting,
    the FSDP paper's), for units of ``sizes`` (root last). Full sharding is k = W."""
    k = shard_group_size or world
    replicas = world // k
    gathered = scattered = 0
    for i, n in enumerate(sizes):
        padded = shard_size(n, k) * k
        gathered += padded * (2 if reshard and i != len(sizes) - 1 else 1)  # root last in ``sizes``
        scattered += padded
    inside = (k - 1) / k * (gathered * compute_bytes + scattered * reduce_bytes)
    across = 2 * (replicas - 1) / replicas * (scattered / k) * reduce_bytes
    return {"shard_group": inside, "replica_group": across}


def traffic(shape: RunShape) -> Traffic:
    """The :class:`Traffic` of a training run of ``shape`` (DDP or the sharded engine)."""
    groups, precision = shape.groups, shape.precision
    if shape.sharded:
        by_group = traffic_bytes(
            shape.unit_sizes, groups.world, groups.shard_ranks,
            precision.compute_bytes, precision.reduce_bytes, shape.reshard_after_forward,
        )  # fmt: skip
    else:  # DDP: every rank holds everything; its gradients are all-reduced over the world
        by_group = traffic_bytes(shape.unit_sizes, groups.world, 1, 4, 4, False)
    link = busiest_link_bytes(step_collectives(shape), groups.ranks_per_node)
    return Traffic(cross_node=link / groups.ranks_per_node, **by_group)


def predicted_step_seconds(shape: RunShape, link_bytes_per_second: float, compute_seconds: float) -> float:
    """Seconds per training step of ``shape`` on a link of ``link_bytes_per_second`` each way:
    ``compute_seconds`` (one step's forward and backward, ``compute.compute_seconds``) times the
    setting's measured cost over DDP's (``knobs.speed_cost``, on one node), plus the bytes the
    busiest node's link carries per step at that speed (the link is not overlapped with compute:
    dev/nodes/bench_two_hosts.py measures how far a setting is from this)."""
    knobs = shape.knobs(list(EXACT_KNOBS)) if shape.builtin else {}
    device = "cuda" if shape.cuda else "cpu"
    link = traffic(shape).cross_node * shape.ranks_per_node
    return compute_seconds * speed_cost(knobs, device) + link / link_bytes_per_second


def link_breakdown(shape: RunShape) -> Dict[str, float]:
    """Bytes node 0 sends over its link per step, by kind of collective."""
    per_node = shape.ranks_per_node
    out: Dict[str, float] = {}
    for collective in step_collectives(shape):
        sent = node_link_bytes(collective, lambda r: r // per_node).get(0, 0.0)
        out[collective.what] = out.get(collective.what, 0.0) + sent
    return out


def step_collectives(shape: RunShape) -> List[Collective]:
    """Every collective of one training step of ``shape`` (see the module docstring)."""
    out = _engine(shape, shape.nccl) if shape.sharded else _ddp(shape)
    world = shape.groups.world
    norms = [m.num_features for m in shape.model.model.modules() if isinstance(m, BatchNormBase)]
    if shape.sync_bn:
        bn_groups = tuple(map(tuple, sync_bn_group_ranks(world, shape.sync_bn_group_size)))
        for channels in norms:  # forward: sums, squares, count; backward: two sums
            out.append(Collective("all_reduce", (2 * channels + 1) * 4, bn_groups, what="sync BN"))
            out.append(Collective("all_reduce", 2 * channels * 4, bn_groups, what="sync BN"))
    else:
        out += _buffer_broadcasts(shape)
    return out + list(shape.loss)


def _engine(shape: RunShape, nccl: bool) -> List[Collective]:
    groups, precision = shape.groups, shape.precision
    k, world = groups.shard_ranks, groups.world
    shards = tuple(shard_group_ranks(world, k))
    replicas = tuple(replica_group_ranks(world, k))
    out = []
    for i, n in enumerate(shape.unit_sizes):
        padded = shard_size(n, k) * k
        if k > 1:
            gathers = 2 if shape.reshard_after_forward and i != len(shape.unit_sizes) - 1 else 1
            out.append(Collective("all_gather", padded * precision.compute_bytes, shards, gathers, "gathers"))
            op = "reduce_scatter" if nccl else "all_reduce"  # gloo: the whole gradient, in place
            out.append(Collective(op, padded * precision.reduce_bytes, shards, 1, "gradient reductions"))
        if world // k > 1:
            shard_bytes = padded // k * precision.reduce_bytes
            out.append(Collective("all_reduce", shard_bytes, replicas, 1, "replica all-reduces"))
    return out


def _ddp(shape: RunShape) -> List[Collective]:
    """DDP's gradient buckets: the first of 1 MiB, then 25 MiB each (its defaults)."""
    world = (tuple(range(shape.groups.world)),)
    total = sum(shape.unit_sizes) * 4
    buckets, left = [], total
    while left > 0:
        size = min(left, DDP_FIRST_BUCKET_BYTES if not buckets else DDP_BUCKET_BYTES)
        buckets.append(size)
        left -= size
    return [Collective("all_reduce", size, world, 1, "gradient reductions") for size in buckets]


def _buffer_broadcasts(shape: RunShape) -> List[Collective]:
    """Without synchronised BatchNorm every training forward starts from the first rank's buffers:
    one broadcast per dtype (DDP: over the world; the engine: the shard group, then the replica
    group)."""
    by_dtype: Dict[object, int] = {}
    for buffer in shape.model.model.buffers():
        by_dtype[buffer.dtype] = by_dtype.get(buffer.dtype, 0) + buffer.numel() * buffer.element_size()
    world, k = shape.groups.world, shape.groups.shard_ranks
    layouts = [(tuple(range(world)),)]
    if shape.sharded:
        layouts = [tuple(shard_group_ranks(world, k)), tuple(replica_group_ranks(world, k))]
    return [
        Collective("broadcast", b, layout, 1, "buffer broadcasts")
        for layout in layouts
        for b in by_dtype.values()
    ]
