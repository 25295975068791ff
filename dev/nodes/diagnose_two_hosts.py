"""Prints where a step's time goes (sync BN, reductions, gathers, compute) across two hosts.

Where a training step's time goes when the ranks talk over a shaped link between two hosts.

    sudo python dev/nodes/diagnose_two_hosts.py [--rate-mbit 200] [--steps 6] [--settings full hybrid ddp]

Builds two hosts (``vistrain/distributed/netns.py``), starts 2 ranks in each and trains
RegNetY-400MF (the quick start's recipe, batch 8 per rank, random 28px crops) as the trainer
does (``parallelize``, the loss, LARS), timing in every rank what it waits for: the engine's
gathers and gradient reductions (its ``wait_within``), synchronised BatchNorm's all-reduces, the
loss's collectives, and DDP's (its backward, where its bucket all-reduces run). Prints per
setting, per step (median over ranks of the mean over steps after the first): the step's time,
the seconds blocked in each kind of wait, the rest (compute and Python), and the collectives that
crossed the link (counted as the planner counts them, ``traffic.step_collectives``).
"""

import argparse
import functools
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from vistrain.distributed.netns import two_hosts
from vistrain.methods import load_config

SETTINGS = {
    "ddp": ["config.MODEL.FSDP_CONFIG.AUTO_SETUP_FSDP=False"],
    "full": ["config.MODEL.FSDP_CONFIG.AUTO_SETUP_FSDP=True", "config.MODEL.FSDP_CONFIG.shard_group_size=0"],
    "hybrid": [
        "config.MODEL.FSDP_CONFIG.AUTO_SETUP_FSDP=True",
        "config.MODEL.FSDP_CONFIG.shard_group_size=2",
    ],
}


def config(setting: str, batch: int, extra):
    return load_config(
        [
            "config=regnet_fsdp",
            "config.MODEL.TRUNK.REGNET.NAME=regnet_y_400mf",
            "config.MODEL.HEAD.DIMS=[440,512,128]",
            f"config.DATA.TRAIN.BATCHSIZE_PER_REPLICA={batch}",
            "config.MODEL.FSDP_CONFIG.AUTO_TUNE=False",
            "config.DISTRIBUTED.NUM_NODES=2",
            "config.DISTRIBUTED.NUM_PROC_PER_NODE=2",
            *SETTINGS[setting],
            *extra,
        ]
    )


class Waits:
    """Seconds this rank spent blocked, by kind, since the last ``take``."""

    def __init__(self):
        self.seconds = {}

    def timed(self, kind, fn):
        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                key = kind(*args) if callable(kind) else kind
                self.seconds[key] = self.seconds.get(key, 0.0) + time.perf_counter() - start

        return wrapper

    def take(self):
        out, self.seconds = self.seconds, {}
        return out


def _engine_kind(work, timeout, what, device):
    text = what() if callable(what) else what
    return "gathers" if "all-gather" in text else "reductions" if "reduc" in text else "engine other"


def install(waits: Waits):
    """Wrap the waits of the engine, sync BN and the loss (this process only)."""
    from vistrain.distributed import comm, sync_batchnorm
    from vistrain.fsdp import collectives, flat_param, reductions

    wrapped = waits.timed(_engine_kind, collectives.wait_within)
    for module in (flat_param, reductions):
        module.wait_within = wrapped
    sync_batchnorm.all_reduce_sum = waits.timed("sync BN", sync_batchnorm.all_reduce_sum)
    comm.all_gather_no_grad = waits.timed("loss", comm.all_gather_no_grad)


def worker(rank: int, port: int, setting: str, steps: int, batch: int, extra):
    from vistrain.methods import build_loss, build_model
    from vistrain.optim import build_optimizer, param_group_key
    from vistrain.runtime.parallel import parallelize
    from vistrain.runtime.sharding import build_for_run

    torch.set_num_threads(1)  # what the launcher gives each of 2 ranks on this 2-core machine
    dist.init_process_group("gloo", init_method=f"tcp://198.18.0.1:{port}", rank=rank, world_size=4)
    waits = Waits()
    install(waits)
    cfg = config(setting, batch, extra)
    torch.manual_seed(0)
    group_key = functools.partial(param_group_key, opt_cfg=cfg.OPTIMIZER)
    model = parallelize(build_for_run(build_model, cfg.MODEL), cfg.MODEL, torch.device("cpu"), group_key)
    criterion, optimizer = build_loss(cfg.LOSS), build_optimizer(cfg.OPTIMIZER, model)
    gen = torch.Generator().manual_seed(rank)
    rows = []
    for _ in range(steps):
        crops = [torch.randn(batch, 3, 28, 28, generator=gen) for _ in range(2)]
        dist.barrier()
        waits.take()
        start = time.perf_counter()
        loss = criterion(model(crops), len(crops))
        backward = time.perf_counter()
        loss.backward()
        backward = time.perf_counter() - backward
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        step = time.perf_counter() - start
        blocked = waits.take()
        if setting == "ddp":  # DDP waits for its buckets inside backward
            blocked["ddp backward"] = backward
        rows.append({"step": step, **blocked})
    dist.barrier()
    dist.destroy_process_group()
    kinds = sorted({k for row in rows for k in row})
    mean = {k: statistics.mean(row.get(k, 0.0) for row in rows[1:]) for k in kinds}  # the first: checks
    print(" ".join(f"{k.replace(' ', '_')}={v:.4f}" for k, v in mean.items()), flush=True)


def crossing(setting: str, batch: int, extra) -> int:
    from vistrain.planner.collectives import crossing_messages
    from vistrain.planner.shape import run_shape
    from vistrain.planner.traffic import step_collectives

    cfg = config(setting, batch, extra)
    count = 0
    for collective in step_collectives(run_shape(cfg)):
        count += collective.calls * (crossing_messages(collective, lambda r: r // 2) > 0)
    return count


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rate-mbit", type=float, default=200.0)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--settings", nargs="+", default=list(SETTINGS))
    parser.add_argument("--extra", nargs="*", default=[], help="config.X=Y overrides for every setting")
    parser.add_argument("--worker", nargs=3, help=argparse.SUPPRESS)  # rank port setting
    args = parser.parse_args()
    if args.worker:
        rank, port, setting = int(args.worker[0]), int(args.worker[1]), args.worker[2]
        return worker(rank, port, setting, args.steps, args.batch, args.extra)
    results = {}
    with two_hosts(args.rate_mbit) as hosts:
        for port, setting in enumerate(args.settings, start=29800):
            procs = []
            for rank in range(4):
                argv = [
                    sys.executable,
                    str(Path(__file__).resolve()),
                    f"--steps={args.steps}",
                    f"--batch={args.batch}",
                ]
                argv += ["--extra", *args.extra, "--worker", str(rank), str(port), setting]
                procs.append(
                    subprocess.Popen(
                        hosts.command(rank // 2, argv),
                        env=hosts.env(rank // 2),
                        stdout=subprocess.PIPE,
                        text=True,
                    )
                )
            outs = [p.communicate()[0].strip().splitlines()[-1] for p in procs]
            ranks = [{k: float(v) for k, v in (kv.split("=") for kv in out.split())} for out in outs]
            kinds = sorted({k for r in ranks for k in r})
            results[setting] = {k: statistics.median(r.get(k, 0.0) for r in ranks) for k in kinds}
    print(
        f"RegNetY-400MF, 2 hosts x 2 ranks, batch {args.batch}, link {args.rate_mbit:g} Mbit/s; seconds per step"
    )
    print("(median over ranks of the mean over steps 2..N), blocked in each kind of wait:")
    for setting, seconds in results.items():
        blocked = {k: v for k, v in seconds.items() if k != "step"}
        rest = seconds["step"] - sum(v for k, v in blocked.items() if k != "ddp_backward")
        shown = ", ".join(f"{k} {v:.2f}" for k, v in blocked.items())
        print(
            f"  {setting:<7} step {seconds['step']:.2f}: {shown}; the rest {rest:.2f}; "
            f"{crossing(setting, args.batch, args.extra)} collectives cross the link"
        )


if __name__ == "__main__":
    main()
