"""Prints the stop check's cost (one all-reduce per iteration) beside a quick start training step.

What the stop check costs: the collective every rank runs at each iteration boundary so that a
stop signal (SIGTERM / SIGUSR1) stops all ranks at the same iteration, next to a training step.

    python dev/bench/bench_stop_check.py [--world 2] [--checks 500] [--steps 6]

Each rank (cores / ranks threads, gloo on CPU) times ``BoundaryStop.requested()`` (one all-reduce
of one int32, ``vistrain/training/preemption.py``) and, in the same processes, one DDP training step
of the quick start's model and batch (``configs/regnet_fsdp.yaml``: 64 images x 2 crops of 28 px,
SimCLR loss). Prints the medians and their ratio.
"""

import argparse
import os
import statistics
import time

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from vistrain.distributed.testing import run_on_ranks
from vistrain.methods import build_loss, build_model, load_config
from vistrain.optim import build_optimizer
from vistrain.training.preemption import BoundaryStop


def measure(rank, world, checks, steps):
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    cfg = load_config(["config=regnet_fsdp", "config.MODEL.FSDP_CONFIG.AUTO_SETUP_FSDP=False"])
    stop = BoundaryStop(cfg, total_iterations=checks)
    check_times = []
    for _ in range(checks):
        start = time.perf_counter()
        assert not stop.requested()
        check_times.append(time.perf_counter() - start)
    torch.manual_seed(0)
    model = DDP(build_model(cfg.MODEL))
    criterion, optimizer = build_loss(cfg.LOSS), build_optimizer(cfg.OPTIMIZER, model)
    batch = cfg.DATA.TRAIN.BATCHSIZE_PER_REPLICA
    crops = [torch.randn(batch, 3, 28, 28) for _ in range(2)]
    step_times = []
    for step in range(steps + 2):  # two warm-up steps
        start = time.perf_counter()
        loss = criterion(model(crops), len(crops))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if step >= 2:
            step_times.append(time.perf_counter() - start)
    return statistics.median(check_times), statistics.median(step_times)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--checks", type=int, default=500)
    parser.add_argument("--steps", type=int, default=6)
    args = parser.parse_args()
    results = run_on_ranks(measure, args.world, args.checks, args.steps)
    check = max(r[0] for r in results)
    step = max(r[1] for r in results)
    print(f"{args.world} gloo ranks, {os.cpu_count()} cores")
    print(f"stop check (all-reduce of one int32), median of {args.checks}: {check * 1e6:.0f} us")
    print(f"quick-start DDP training step, median of {args.steps}: {step * 1e3:.0f} ms")
    print(f"check / step: {check / step:.2%}")


if __name__ == "__main__":
    main()
