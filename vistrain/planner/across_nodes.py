"""The auto-tuner's choice of ``shard_group_size`` in a job that spans nodes, made by its ranks.

Before the ranks start, every node's launcher plans the fastest setting that fits memory for each
shard group size worth trying (``knobs.shard_group_choices``: all ranks, a node, one rank); which
of them is fastest depends on the link between the nodes, which only the ranks can measure. So at
the start of training, before anything is built:

1. rank 0 measures a step's compute on this machine (``compute.compute_seconds``, unit by unit);
2. the link's speed comes from ``MACHINE.INTER_NODE_GBPS``, else from a short timed all-reduce
   between the first ranks of the nodes (:func:`measure_link`), each way;
3. rank 0 predicts every candidate's step time (``traffic.predicted_step_seconds``: compute
   times the setting's measured cost over DDP's, plus the bytes the busiest link carries at that
   speed), takes the fastest and tells everyone; the others follow (one decision, so nodes never
   disagree). ``config.yaml`` records the choice.
"""

import time
from typing import Dict, List, Sequence, Tuple

import torch
import torch.distributed as dist

from vistrain.planner.compute import compute_seconds
from vistrain.planner.knobs import with_knobs
from vistrain.planner.shape import MIB, run_shape
from vistrain.planner.traffic import predicted_step_seconds

Setting = Dict[str, object]
PROBE_BYTES = (1 * MIB, 8 * MIB)  # two sizes: their time difference leaves the latency out


def measure_link(per_node: int, device: torch.device) -> float:
    """Bytes per second the link between nodes carries each way, from all-reduces of
    ``PROBE_BYTES`` among the nodes' first ranks (a ring: each link carries 2 (N - 1) / N of the
    tensor each way). Collective: every rank calls it (the others wait)."""
    world = dist.get_world_size()
    leaders = list(range(0, world, per_node))
    group = dist.new_group(leaders)  # every rank, members or not
    seconds = []
    if dist.get_rank() in leaders:
        for nbytes in PROBE_BYTES:
            tensor = torch.zeros(nbytes // 4, device=device)
            dist.all_reduce(tensor, group=group)  # connections made, pages touched
            best = float("inf")
            for _ in range(2):
                dist.barrier(group=group)
                start = time.perf_counter()
                dist.all_reduce(tensor, group=group)
                best = min(best, time.perf_counter() - start)
            seconds.append(best)
    measured = torch.tensor(seconds or [0.0, 0.0], dtype=torch.float64)
    dist.broadcast(measured, src=0)
    nodes = len(leaders)
    carried = 2 * (nodes - 1) / nodes * (PROBE_BYTES[1] - PROBE_BYTES[0])
    return carried / max(float(measured[1] - measured[0]), 1e-9)


def choose_across_nodes(
    cfg, candidates: Sequence[Tuple[Setting, float]], layout: Setting, device: torch.device
):
    """``(cfg with the fastest of ``candidates``' knobs, the log line)``; ``layout``: the job's
    nodes and ranks (``auto_tune.Tuned.layout``). Collective over the world."""
    shape = run_shape(with_knobs(cfg, layout))
    given = cfg.MACHINE.INTER_NODE_GBPS
    bandwidth = given * 1e9 / 8 if given > 0 else measure_link(shape.ranks_per_node, device)
    decision: List[object] = [None]
    if dist.get_rank() == 0:
        compute = compute_seconds(shape, device)
        predicted = [
            predicted_step_seconds(shape.with_knobs(knobs), bandwidth, compute) for knobs, _ in candidates
        ]
        best = min(range(len(candidates)), key=predicted.__getitem__)
        decision = [(best, _line(candidates, predicted, best, bandwidth, given > 0, compute))]
    dist.broadcast_object_list(decision, src=0)
    best, line = decision[0]
    return with_knobs(cfg, candidates[best][0]), line


def _line(candidates, predicted, best: int, bandwidth: float, given: bool, compute: float) -> str:
    source = "MACHINE.INTER_NODE_GBPS" if given else "measured"
    knobs, peak = candidates[best]
    others = "; ".join(
        f"shard_group_size={c[0]['shard_group_size']}: {p:.2f} s"
        for i, (c, p) in enumerate(zip(candidates, predicted))
        if i != best
    )
    return (
        f"auto-tune across nodes: link {bandwidth * 8 / 1e9:.3g} Gbit/s ({source}), compute "
        f"{compute:.2f} s per step: chose shard_group_size={knobs['shard_group_size']} "
        f"(predicted {predicted[best]:.2f} s per step, planned {peak / MIB:,.0f} MiB per rank); {others}"
    )
