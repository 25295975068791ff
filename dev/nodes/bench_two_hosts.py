"""Prints link bytes and seconds per step of DDP, full, hybrid and auto-tuned sharding on two hosts.

Two hosts joined by a shaped link: bytes and seconds per training step of DDP, full sharding,
hybrid sharding and the auto-tuned setting, beside the planner's figures.

    sudo python dev/nodes/bench_two_hosts.py [--rate-mbit 200] [--ranks-per-host 2] [--rounds 1]
        [--steps 6 2] [--batch 8] [--model regnet_y_400mf] [--head 440,512,128]

Builds two hosts (network namespaces joined by a veth pair, each direction limited to
``--rate-mbit`` by tbf; ``vistrain/distributed/netns.py``) and runs every setting through the
launcher's multi-node mode, as a user runs two machines: in each host ``tools/run_distributed.py
config=regnet_fsdp`` with ``DISTRIBUTED.NUM_NODES=2``, ``NODE_ID``, ``RUN_ID=<host A's
address>:<port>`` and ``GLOO_SOCKET_IFNAME`` set to the host's veth end. Each run trains the quick
start's recipe with ``--model`` (the digits, batch ``--batch`` per rank, one epoch of exactly N
steps: ``DATA.TRAIN.DATA_LIMIT``). Per step means a run of ``--steps`` [0] steps minus one of
[1] steps, divided by the difference: start-up, the first step's checks and the final checkpoint
cancel. Bytes are what host A's veth end sent (``statistics/tx_bytes``: every frame, headers
included); seconds are rank 0's training time (from the loop's start to its last step, as the
run's one log line gives it: start-up and exit, slow on a loaded machine, are left out).

Printed per setting: MiB host A sent per step; the planner's figure for it
(``vistrain.planner.traffic.traffic``: ``cross_node`` x ranks per host) and their ratio; seconds
per step; the link's byte floor (MiB per step over the rate) and the step's ratio to it; the
planner's predicted step time at the rate (``traffic.predicted_step_seconds``). The auto-tuned run's
choice is read from its config.yaml.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from vistrain.distributed.netns import two_hosts, unavailable_reason
from vistrain.methods import load_config
from vistrain.planner.auto_tune import available_memory_mib
from vistrain.planner.compute import compute_seconds
from vistrain.planner.shape import run_shape
from vistrain.planner.traffic import predicted_step_seconds, traffic

REPO = Path(__file__).resolve().parents[2]
RUN = str(REPO / "tools" / "run_distributed.py")
MIB = 2**20
RANK_MIB = 1100  # a rank of RegNetY-400MF at batch 8 (peak RSS, measured), with room
SPARE_MIB = 8192  # left to others on the machine


def settings(per_host: int):
    engine = ["config.MODEL.FSDP_CONFIG.AUTO_SETUP_FSDP=True", "config.MODEL.FSDP_CONFIG.AUTO_TUNE=False"]
    return {
        "ddp": ["config.MODEL.FSDP_CONFIG.AUTO_SETUP_FSDP=False", "config.MODEL.FSDP_CONFIG.AUTO_TUNE=False"],
        "full sharding": [*engine, "config.MODEL.FSDP_CONFIG.shard_group_size=0"],
        f"hybrid, k={per_host}": [*engine, f"config.MODEL.FSDP_CONFIG.shard_group_size={per_host}"],
        "auto-tuned": [
            "config.MODEL.FSDP_CONFIG.AUTO_SETUP_FSDP=True",
            "config.MODEL.FSDP_CONFIG.AUTO_TUNE=True",
        ],
    }


def job_args(args, steps: int, run_dir: Path, overrides):
    world = 2 * args.ranks_per_host
    return [
        "config=regnet_fsdp",
        f"config.MODEL.TRUNK.REGNET.NAME={args.model}",
        f"config.MODEL.HEAD.DIMS=[{args.head}]",
        f"config.DATA.TRAIN.BATCHSIZE_PER_REPLICA={args.batch}",
        f"config.DATA.TRAIN.DATA_LIMIT={steps * args.batch * world}",
        "config.OPTIMIZER.num_epochs=1",
        "config.LOG_FREQUENCY=1000",  # one log (the last step) in every run: it cancels
        f"config.DISTRIBUTED.NUM_PROC_PER_NODE={args.ranks_per_host}",
        "config.DISTRIBUTED.NUM_NODES=2",
        f"config.CHECKPOINT.DIR={run_dir}",
        *overrides,
    ]


def run_job(hosts, args, steps: int, run_dir: Path, overrides, port: int):
    """(training seconds, bytes host A sent, bytes host B sent) of one two-host job."""
    base = job_args(args, steps, run_dir, overrides)
    rendezvous = f"config.DISTRIBUTED.RUN_ID={hosts.addresses[0]}:{port}"
    sent = [hosts.tx_bytes(h) for h in (0, 1)]
    procs, logs = [], []
    for host in (0, 1):
        log = open(f"{run_dir}.host{host}.log", "w")  # noqa: SIM115  closed below
        argv = [sys.executable, RUN, *base, f"config.DISTRIBUTED.NODE_ID={host}", rendezvous]
        procs.append(
            subprocess.Popen(
                hosts.command(host, argv), env=hosts.env(host), stdout=log, stderr=subprocess.STDOUT, cwd=REPO
            )
        )
        logs.append(log)
    try:
        codes = [p.wait() for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        for log in logs:
            log.close()
    if any(codes):
        text = Path(f"{run_dir}.host{codes.index(next(c for c in codes if c))}.log").read_text()
        raise SystemExit(f"job failed ({' '.join(overrides)}):\n{text[-4000:]}")
    images = steps * args.batch * 2 * args.ranks_per_host
    return training_seconds(run_dir, images), hosts.tx_bytes(0) - sent[0], hosts.tx_bytes(1) - sent[1]


def training_seconds(run_dir: Path, images: int) -> float:
    """From the training meter's start to the last step's log (the run's only log line; its img/s
    is over that window): start-up before the loop and the exit after it are left out."""
    records = map(json.loads, Path(run_dir, "metrics.jsonl").read_text().splitlines())
    record = [r for r in records if "loss" in r][-1]  # the last step's (not a monitor record)
    return images / record["images_per_sec"]


def planner_figures(run_dir: Path, rate_mbit: float, compute: float):
    """(planned MiB host A sends per step, predicted seconds per step) from the run's config.yaml;
    ``compute``: seconds of a step's forward and backward on a rank here."""
    shape = run_shape(load_config([f"config={run_dir / 'config.yaml'}"]))
    link = traffic(shape).cross_node * shape.ranks_per_node
    return link / MIB, predicted_step_seconds(shape, rate_mbit * 1e6 / 8, compute)


def rank_compute_seconds(args) -> float:
    """A rank's forward and backward here (``compute.compute_seconds``, one rank's threads), times
    how oversubscribed the cores are: both hosts' ranks share this one machine's cores."""
    ranks = 2 * args.ranks_per_host
    threads = max(1, (os.cpu_count() or 1) // args.ranks_per_host)  # what the launcher gives a rank
    torch.set_num_threads(threads)
    shape = run_shape(load_config(job_args(args, 1, Path("unused"), [])))
    return compute_seconds(shape, torch.device("cpu")) * max(1.0, ranks * threads / (os.cpu_count() or 1))


def chosen(run_dir: Path) -> str:
    cfg = load_config([f"config={run_dir / 'config.yaml'}"])
    fsdp = cfg.MODEL.FSDP_CONFIG
    return (
        f"shard_group_size={fsdp.shard_group_size}, {fsdp.wrap_granularity}, "
        f"{'ZeRO-3' if fsdp.reshard_after_forward else 'ZeRO-2'}"
    )


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rate-mbit", type=float, default=200.0)
    parser.add_argument("--ranks-per-host", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--steps", type=int, nargs=2, default=[6, 2], metavar=("LONG", "SHORT"))
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--model", default="regnet_y_400mf")
    parser.add_argument("--head", default="440,512,128")
    parser.add_argument("--only", nargs="*", help="run only these settings (names as printed)")
    args = parser.parse_args()
    reason = unavailable_reason()
    if reason:
        raise SystemExit(f"cannot build two hosts here: {reason}")
    need = 2 * args.ranks_per_host * RANK_MIB + SPARE_MIB
    if available_memory_mib() < need:
        raise SystemExit(
            f"{available_memory_mib():,.0f} MiB available; this needs {need:,} MiB (others' share kept)"
        )
    table = {
        name: over
        for name, over in settings(args.ranks_per_host).items()
        if not args.only or name in args.only
    }
    long, short = args.steps
    results = {name: [] for name in table}
    with tempfile.TemporaryDirectory() as tmp, two_hosts(args.rate_mbit) as hosts:
        port = 29500
        for r in range(args.rounds):
            for i, (name, overrides) in enumerate(table.items()):
                runs = {}
                for steps in (long, short):
                    port += 1
                    run_dir = Path(tmp, f"{r}-{i}-{steps}")
                    runs[steps] = run_job(hosts, args, steps, run_dir, overrides, port)
                (t_long, a_long, b_long), (t_short, a_short, b_short) = runs[long], runs[short]
                per_step = [(t_long - t_short), (a_long - a_short), (b_long - b_short)]
                per_step = [x / (long - short) for x in per_step]
                results[name].append((*per_step, Path(tmp, f"{r}-{i}-{long}")))
                for line in Path(tmp, f"{r}-{i}-{long}", "log.txt").read_text().splitlines():
                    if "auto-tune across nodes" in line:
                        print(line.split("] ", 1)[-1], flush=True)
                print(
                    f"round {r + 1} {name:<16} {per_step[1] / MIB:7.1f} MiB/step  {per_step[0]:6.2f} s/step",
                    flush=True,
                )
        report(args, results)


def report(args, results):
    rate = args.rate_mbit * 1e6 / 8  # bytes per second each way
    compute = rank_compute_seconds(args)
    print(
        f"\n{args.model}, {args.ranks_per_host} ranks per host x 2 hosts, batch {args.batch} per rank, "
        f"link {args.rate_mbit:g} Mbit/s each way (tbf); per step = ({args.steps[0]}-step run - "
        f"{args.steps[1]}-step run) / {args.steps[0] - args.steps[1]}, median of {args.rounds} round(s); "
        f"planned s: {compute:.2f} s compute (measured here unit by unit, cores shared by both hosts) x "
        f"the setting's cost over DDP's + the link's bytes at the rate"
    )
    header = (
        "setting",
        "A sent MiB",
        "B sent MiB",
        "planned MiB",
        "vs planned",
        "s/step",
        "floor s",
        "x floor",
        "planned s",
    )
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for name, rows in results.items():
        seconds = statistics.median(r[0] for r in rows)
        sent_a = statistics.median(r[1] for r in rows)
        sent_b = statistics.median(r[2] for r in rows)
        planned_mib, planned_s = planner_figures(rows[0][3], args.rate_mbit, compute)
        floor = max(sent_a, sent_b) / rate
        label = f"{name} ({chosen(rows[0][3])})" if name == "auto-tuned" else name
        cells = [
            label, f"{sent_a / MIB:.1f}", f"{sent_b / MIB:.1f}", f"{planned_mib:.1f}",
            f"{sent_a / MIB / planned_mib - 1:+.0%}" if planned_mib else "n/a",
            f"{seconds:.2f}", f"{floor:.2f}", f"{seconds / floor:.1f}" if floor else "n/a", f"{planned_s:.2f}",
        ]  # fmt: skip
        print("| " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
