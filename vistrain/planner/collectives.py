"""What one collective sends over the links between nodes, as gloo runs it.

torch's ``ProcessGroupGloo`` calls gloo's algorithms on CPU tensors (gloo/allgather.cc,
allreduce.cc, broadcast.cc), each over the group's ranks in ascending order (``new_group`` sorts
them) at positions 0..P-1:

- **all-gather** (also the list form, which gathers into one flat buffer and copies out): a ring,
  position i sends to i + 1; every edge carries P - 1 pieces of S / P bytes (S: the gathered
  tensor), each piece in two messages.
- **all-reduce**: a ring the other way, position i sends to i - 1: a reduce-scatter, then an
  all-gather of the reduced chunks; at least 2P segments of S / (2P), so every edge carries
  2 (P - 1) / P * S in 4 (P - 1) messages (gloo picks no other algorithm for it).
- **reduce-scatter** (NCCL only; the engine's gradient reduction on CUDA): a ring as the
  all-gather's, P - 1 chunks of S / P per edge (NCCL's rings cross each node boundary once, as
  this ascending ring does).
- **broadcast**: a binomial tree from the root: in round j the first 2^j positions counted from
  the root send the whole tensor to the position 2^j further on; S per tree edge, one message.

An edge between ranks on different nodes crosses the link; a node's link carries the sum of its
ranks' outgoing crossing edges. Each crossing message also costs ``MESSAGE_BYTES_SENT`` more
from its sender (Ethernet, IP, TCP and gloo headers) and ``MESSAGE_BYTES_RETURNED`` from its
receiver (gloo's ready-to-receive notice, TCP acknowledgements). ``dev/nodes/probe_gloo_link.py``
measures every case on two network namespaces against this model.
"""

from dataclasses import dataclass
from typing import Callable, Dict, List, Sequence, Tuple

Ranks = Tuple[int, ...]
# Measured by dev/nodes/probe_gloo_link.py (2 x 2 ranks, messages of 1-8 KiB): a broadcast's sender pays
# 236 bytes per message; a ring step (a message out, one in) 415 bytes from each side.
MESSAGE_BYTES_SENT = 236
MESSAGE_BYTES_RETURNED = 180
OPS = ("all_gather", "all_reduce", "broadcast")  # what gloo runs for the engine, DDP and the losses


@dataclass(frozen=True)
class Collective:
    """One collective of a training step: ``op`` on a tensor of ``nbytes`` (the gathered output,
    the reduced or broadcast tensor), issued at once on each group of ``groups`` (the groups
    cover the ranks that take part: the shard groups, or the replica groups), ``calls`` times."""

    op: str
    nbytes: float
    groups: Tuple[Ranks, ...]
    calls: int = 1
    what: str = ""  # for breakdowns: "gathers", "reductions", "sync BN", ...


def edges(op: str, size: int) -> List[Tuple[int, int, float, int]]:
    """``(from position, to position, share of S, messages)`` of every edge of ``op`` over ``size``
    positions (root at position 0 for a broadcast)."""
    if size < 2:
        return []
    if op in ("all_gather", "reduce_scatter"):
        return [(i, (i + 1) % size, (size - 1) / size, 2 * (size - 1)) for i in range(size)]
    if op == "all_reduce":
        return [(i, (i - 1) % size, 2 * (size - 1) / size, 4 * (size - 1)) for i in range(size)]
    if op == "broadcast":
        out, span = [], 1
        while span < size:
            out += [(i, i + span, 1.0, 1) for i in range(span) if i + span < size]
            span *= 2
        return out
    raise ValueError(f"collective must be one of {OPS + ('reduce_scatter',)}, got {op!r}")


def node_link_bytes(collective: Collective, node_of: Callable[[int], int]) -> Dict[int, float]:
    """Bytes each node sends over its link per step for ``collective`` (nodes that send
    nothing are absent)."""
    sent: Dict[int, float] = {}
    for ranks in collective.groups:
        for start, end, share, messages in edges(collective.op, len(ranks)):
            src, dst = node_of(ranks[start]), node_of(ranks[end])
            if src == dst:
                continue
            sent[src] = sent.get(src, 0.0) + share * collective.nbytes + messages * MESSAGE_BYTES_SENT
            sent[dst] = sent.get(dst, 0.0) + messages * MESSAGE_BYTES_RETURNED
    return {node: total * collective.calls for node, total in sent.items()}


def crossing_messages(collective: Collective, node_of: Callable[[int], int]) -> int:
    """Messages of ``collective`` that cross a link, per step (each waits for the one before it
    on its edge: latency adds up along them)."""
    count = 0
    for ranks in collective.groups:
        for start, end, _, messages in edges(collective.op, len(ranks)):
            count += messages * (node_of(ranks[start]) != node_of(ranks[end]))
    return count * collective.calls


def busiest_link_bytes(collectives: Sequence[Collective], ranks_per_node: int) -> float:
    """The most bytes any node sends over its link per step for all of ``collectives``."""
    totals: Dict[int, float] = {}
    for collective in collectives:
        for node, nbytes in node_link_bytes(collective, lambda r: r // ranks_per_node).items():
            totals[node] = totals.get(node, 0.0) + nbytes
    return max(totals.values(), default=0.0)
