"""Prints the engine's CPU time per step as a ratio to DDP's, and its aten ops and Python calls per step, for several source trees side by side.

    python dev/bench/bench_fsdp_views.py [--tree NAME=PATH ...] [--repeats 3] [--steps 10]
        [--batch 8] [--size 64] [--model regnet_y_400mf] [--granularity block] [--zero2]

Each ``--tree`` is a checkout of this repository (another commit: ``git worktree add --detach
PATH COMMIT``); without one, the current tree alone. Every repeat runs each tree, in an order
rotated per repeat, in a fresh pair of gloo ranks of one thread each (``PYTHONPATH`` at the
tree), where DDP's step and the engine's alternate on the same data. Per step and rank it takes
the process's CPU time (``time.process_time``: gloo's threads included), the main thread's
(``time.thread_time``) and the wall time; a tree's figure is the slowest rank's median engine
step over its median DDP step in the same processes, so load from other jobs on the machine
mostly cancels. Printed per tree: the median over repeats and the range. Then, from one more
step of each tree: aten ops per step (``torch.profiler``; total and the view/copy family),
Python function calls per step (``cProfile``; total and those in ``vistrain/fsdp``), collectives
per step, and the parameters the optimizer steps.
"""

import argparse
import cProfile
import json
import os
import pstats
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
OPS = (
    "aten::view",
    "aten::as_strided",
    "aten::slice",
    "aten::detach",
    "aten::copy_",
    "aten::add_",
    "aten::zero_",
)
CLOCKS = ("process", "thread", "wall")


def build(name):
    import torch
    import torchvision

    torch.manual_seed(0)
    return getattr(torchvision.models, name)(num_classes=10)


def worker(rank, world, args):
    """One rank: interleaved DDP and engine steps; returns medians, op and call counts."""
    import torch
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel as DDP

    from vistrain.fsdp import RootOptions, auto_wrap, hybrid_groups
    from vistrain.runtime.sharding import wrap_policy

    torch.set_num_threads(1)
    engine = auto_wrap(
        build(args["model"]),
        wrap_policy(False, args["granularity"]),
        groups=hybrid_groups(0),
        reshard_after_forward=not args["zero2"],
        root=RootOptions(),
    )
    models = {"ddp": DDP(build(args["model"])), "engine": engine}
    optimizers = {k: torch.optim.SGD(m.parameters(), lr=0.01, momentum=0.9) for k, m in models.items()}
    gen = torch.Generator().manual_seed(rank)
    x = torch.randn(args["batch"], 3, args["size"], args["size"], generator=gen)
    y = torch.randint(0, 10, (args["batch"],), generator=gen)

    def step(name):
        loss = nn.functional.cross_entropy(models[name](x), y)
        loss.backward()
        optimizers[name].step()
        optimizers[name].zero_grad(set_to_none=False)

    times = {(name, clock): [] for name in models for clock in CLOCKS}
    for i in range(args["steps"] + 2):
        for name in ("ddp", "engine") if i % 2 else ("engine", "ddp"):
            start = (time.process_time(), time.thread_time(), time.perf_counter())
            step(name)
            end = (time.process_time(), time.thread_time(), time.perf_counter())
            if i >= 2:  # warm-up
                for clock, a, b in zip(CLOCKS, start, end):
                    times[(name, clock)].append(b - a)
    out = {f"{name} {clock}": statistics.median(t) for (name, clock), t in times.items()}
    out.update(counts(lambda: step("engine")))
    out["optimizer params"] = sum(len(g["params"]) for g in optimizers["engine"].param_groups)
    return out


def counts(step):
    """aten ops and Python calls of one step (after the timed ones)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        step()
    ops = {e.key: e.count for e in prof.key_averages()}
    out = {"aten ops": sum(c for k, c in ops.items() if k.startswith("aten::"))}
    out.update({op: ops.get(op, 0) for op in OPS})
    out["collectives"] = sum(c for k, c in ops.items() if k.startswith("c10d::") or k.startswith("gloo:"))
    calls = cProfile.Profile()
    calls.enable()
    step()
    calls.disable()
    stats = pstats.Stats(calls).stats
    out["python calls"] = sum(v[1] for v in stats.values())
    out["python calls in fsdp"] = sum(v[1] for k, v in stats.items() if f"vistrain{os.sep}fsdp" in k[0])
    return out


def child(args):
    from vistrain.distributed.testing import run_on_ranks

    results = run_on_ranks(worker, 2, args)
    out = {}
    for clock in CLOCKS:  # the slowest rank's ratio sets the pace
        out[f"{clock} ratio"] = max(r[f"engine {clock}"] / r[f"ddp {clock}"] for r in results)
        out[f"ddp {clock} s"] = max(r[f"ddp {clock}"] for r in results)
    out.update({k: v for k, v in results[0].items() if not k.startswith(("engine ", "ddp "))})
    print(json.dumps(out))


def run_tree(path, args):
    env = dict(os.environ, PYTHONPATH=str(path), OMP_NUM_THREADS="1")
    payload = json.dumps(vars(args))
    proc = subprocess.run(
        [sys.executable, __file__, "--child", payload], env=env, capture_output=True, text=True, check=False
    )
    if proc.returncode:
        raise SystemExit(f"tree {path} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main():
    if len(sys.argv) == 3 and sys.argv[1] == "--child":
        return child(json.loads(sys.argv[2]))
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tree", action="append", default=[], help="NAME=PATH (repeatable)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--size", type=int, default=64)
    parser.add_argument("--model", default="regnet_y_400mf")
    parser.add_argument("--granularity", default="block")
    parser.add_argument("--zero2", action="store_true", help="reshard_after_forward off")
    args = parser.parse_args()
    trees = dict(t.split("=", 1) for t in args.tree) or {"this tree": str(REPO)}
    del args.tree
    runs = {name: [] for name in trees}
    names = list(trees)
    for r in range(args.repeats):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            runs[name].append(run_tree(trees[name], args))
    print(
        f"{args.model}, {args.size}x{args.size}, batch {args.batch}/rank, 2 gloo ranks x 1 thread, "
        f"{args.granularity} {'zero2' if args.zero2 else 'zero3'}, {args.repeats} repeats of "
        f"{args.steps} steps, engine step / DDP step in the same processes: median [min-max]"
    )
    print(
        f"{'tree':<12}"
        + "".join(f"{c + ' CPU' if c != 'wall' else c:>22}" for c in CLOCKS)
        + "  DDP process s"
    )
    for name, rs in runs.items():
        cells = []
        for clock in CLOCKS:
            v = [r[f"{clock} ratio"] for r in rs]
            cells.append(f"{statistics.median(v):.3f} [{min(v):.3f}-{max(v):.3f}]")
        ddp = statistics.median(r["ddp process s"] for r in rs)
        print(f"{name:<12}" + "".join(f"{c:>22}" for c in cells) + f"  {ddp:12.3f}")
    keys = ["optimizer params", "collectives", "aten ops", *OPS, "python calls", "python calls in fsdp"]
    print("per engine step (rank 0, one step):")
    print(f"{'':<22}" + "".join(f"{n:>12}" for n in names))
    for key in keys:
        print(f"{key:<22}" + "".join(f"{runs[n][-1][key]:>12}" for n in names))


if __name__ == "__main__":
    main()
