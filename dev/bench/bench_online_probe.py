"""Prints what the online linear probe adds to a training step: the median time of its step (its
linear forward and backward, one all-reduce of its gradient and feature moments, SGD) on 2 gloo
ranks, one thread each, for the quick start's shapes (2 crops x 64 images of a 64-wide avgpool
feature, 10 classes) and a wider trunk's.

    python dev/bench/bench_online_probe.py [--steps 200]
"""

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from vistrain.distributed.testing import run_on_ranks
from vistrain.training.online_probe import OnlineProbe

SHAPES = [(128, 64, 10), (128, 368, 10), (512, 2048, 1000)]  # (rows, D, classes)


class _Trunk(nn.Module):
    def forward(self, x):
        return {"avgpool": x}


def _time_on_rank(rank, world_size, steps):
    out = []
    for rows, dim, classes in SHAPES:
        probe = OnlineProbe(_Trunk(), ("avgpool", 1, dim), classes, (0.1, steps), 0, torch.device("cpu"))
        x = torch.randn(rows, dim)
        batch = {"label": torch.randint(0, classes, (rows // 2,))}
        times = []
        for step in range(steps):
            with probe.reading():
                probe.trunk(x)
            start = time.perf_counter()
            probe.step(batch, step)
            times.append(time.perf_counter() - start)
        out.append(statistics.median(times[steps // 10 :]))
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    args = parser.parse_args()
    ranks = run_on_ranks(_time_on_rank, 2, args.steps)
    for (rows, dim, classes), *seconds in zip(SHAPES, *ranks):
        print(
            f"{rows} rows x {dim} features -> {classes} classes: {1e3 * max(seconds):.2f} ms per step (2 ranks)"
        )


if __name__ == "__main__":
    main()
