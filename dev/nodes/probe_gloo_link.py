"""Prints the bytes gloo sends over a link between two hosts, one collective at a time.

What gloo sends over the link between two hosts, one collective at a time.

    sudo python dev/nodes/probe_gloo_link.py [--ranks-per-host 2] [--rate-mbit 0] [--reps 4]

Builds two hosts (network namespaces joined by a veth pair, ``vistrain/distributed/netns.py``),
starts ``--ranks-per-host`` gloo ranks in each, and for every collective the engine issues
(all-gather into a list, all-reduce, broadcast; over the world, the shard groups of one host and
the replica groups across hosts, all groups of a kind at once as the engine runs them) and several
sizes counts the bytes host A's veth end sent (``tx_bytes``), minus the same loop's barriers
alone. Prints per call the measured bytes, the traffic model's (``vistrain/planner/collectives.py``) and
their ratio.
"""

import argparse
import functools
import os
import subprocess
import sys
import time

import torch
import torch.distributed as dist

from vistrain.distributed.launch import find_free_port
from vistrain.distributed.netns import two_hosts
from vistrain.planner.collectives import OPS, Collective, node_link_bytes

SIZES = (256, 16_384, 262_144, 2_097_152)  # fp32 elements per rank's piece (1 KiB .. 8 MiB)


def groups_of(kind: str, world: int, per_host: int):
    """Rank tuples of each group of ``kind``: world, shard (one per host), replica (across)."""
    if kind == "world":
        return [tuple(range(world))]
    if kind == "shard":
        return [tuple(range(h * per_host, (h + 1) * per_host)) for h in range(world // per_host)]
    return [tuple(range(p, world, per_host)) for p in range(per_host)]


def collective(op: str, n: int, group, ranks):
    """Run ``op`` once on ``group`` with pieces of ``n`` fp32 elements."""
    size = len(ranks)
    if op == "all_gather":  # the engine's gather on gloo: a list of views of one output
        out = torch.empty(size * n)
        dist.all_gather(list(out.chunk(size)), torch.ones(n), group=group)
    elif op == "all_reduce":  # the engine's gradient reduction on gloo: the full vector
        dist.all_reduce(torch.ones(n * size), group=group)
    elif op == "broadcast":
        dist.broadcast(torch.ones(n * size), src=ranks[0], group=group)
    elif op == "reduce_scatter":  # what the engine does not use on gloo (see --ops)
        dist.reduce_scatter_tensor(torch.empty(n), torch.ones(n * size), group=group)


def run_all(op: str, n: int, groups):
    for ranks, group in groups:
        collective(op, n, group, ranks)


def tx_bytes(interface: str) -> int:
    with open(f"/sys/class/net/{interface}/statistics/tx_bytes") as f:
        return int(f.read())


def worker(rank: int, world: int, per_host: int, port: int, reps: int, interface: str, ops):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://198.18.0.1:{port}", rank=rank, world_size=world)
    made = {
        kind: [(r, dist.new_group(list(r))) for r in groups_of(kind, world, per_host)]
        for kind in ("shard", "replica")
    }
    made["world"] = [(tuple(range(world)), dist.group.WORLD)]
    measure = rank == 0  # host A's first rank reads host A's counter

    def counted(body):
        dist.barrier()
        time.sleep(0.2)  # let the barrier's last frames (and acks) leave
        start = tx_bytes(interface) if measure else 0
        for _ in range(reps):
            body()
        dist.barrier()
        time.sleep(0.2)
        return (tx_bytes(interface) - start) if measure else 0

    baseline = counted(lambda: None)
    for kind, groups in made.items():
        mine = [(ranks, g) for ranks, g in groups if rank in ranks]
        for op in ops:
            for n in SIZES:
                for ranks, g in mine:
                    collective(op, n, g, ranks)  # warm-up: connections made
                got = counted(functools.partial(run_all, op, n, mine))
                if measure:
                    print(f"{kind} {op} {n} {(got - baseline) / reps:.0f}", flush=True)
    dist.barrier()
    dist.destroy_process_group()


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks-per-host", type=int, default=2)
    parser.add_argument("--rate-mbit", type=float, default=0.0, help="0: unshaped")
    parser.add_argument("--reps", type=int, default=4)
    parser.add_argument("--ops", nargs="+", default=list(OPS), help=f"of {OPS + ('reduce_scatter',)}")
    parser.add_argument("--worker", type=int, nargs=3, help=argparse.SUPPRESS)  # rank port host
    args = parser.parse_args()
    per_host = args.ranks_per_host
    world = 2 * per_host
    if args.worker:
        rank, port, interface = args.worker[0], args.worker[1], os.environ["GLOO_SOCKET_IFNAME"]
        return worker(rank, world, per_host, port, args.reps, interface, args.ops)

    with two_hosts(args.rate_mbit or None) as hosts:
        port = find_free_port()
        procs = []
        for rank in range(world):
            host = rank // per_host
            argv = [
                sys.executable,
                __file__,
                f"--ranks-per-host={per_host}",
                f"--reps={args.reps}",
                "--ops",
                *args.ops,
            ]
            argv += ["--worker", str(rank), str(port), str(host)]
            procs.append(
                subprocess.Popen(
                    hosts.command(host, argv), env=hosts.env(host), stdout=subprocess.PIPE, text=True
                )
            )
        out = procs[0].communicate()[0]
        for p in procs[1:]:
            p.wait()
    print(f"{per_host} ranks per host, bytes host A sent per call (pieces of n fp32 elements per rank)")
    print(f"{'group':<8} {'collective':<11} {'n':>9} {'measured':>12} {'model':>12} {'ratio':>6}")
    for line in out.splitlines():
        kind, op, n, got = line.split()
        groups = groups_of(kind, world, per_host)
        collective = Collective(op, int(n) * 4 * len(groups[0]), tuple(groups))
        model = node_link_bytes(collective, lambda r: r // per_host).get(0, 0.0)
        ratio = float(got) / model if model else float("nan")
        print(f"{kind:<8} {op:<11} {int(n):>9,} {float(got):>12,.0f} {model:>12,.0f} {ratio:>6.3f}")


if __name__ == "__main__":
    main()
