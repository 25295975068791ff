"""Prints the monitor pass's seconds beside an epoch's, per demo, and its share at MONITOR.EVERY_EPOCHS=N.

The training monitor (kNN top-1, RankMe, feature std: vistrain/training/monitor.py) timed inside
one run of each demo (the quick start ``regnet_fsdp`` and ``pretrain/dino_vit_demo``, 2 ranks, as
shipped) with ``MONITOR.EVERY_EPOCHS=1``: each pass records its own seconds (``monitor_seconds``)
and the training's since the previous pass (``train_seconds``: one epoch, with its checkpoint) in
metrics.jsonl. Measuring both in the same run keeps a shared machine's load out of the ratio.

    python dev/bench/bench_monitor.py [--epochs 4] [--demos regnet_fsdp pretrain/dino_vit_demo | all]

Prints per demo every pass (the first epoch holds the start-up and the first pass reads the
held-out images from disk: both are left out of the median), the median pass / epoch ratio, the
share of the training time the monitor takes every N epochs, pass / (N x epoch + pass), and the
smallest N whose share is within ``--budget`` (5%).
"""

import argparse
import json
import math
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def monitor_records(config: str, epochs: int, run_dir: Path, extra=()) -> list:
    cmd = [
        sys.executable, str(REPO / "tools" / "run_distributed.py"), f"config={config}",
        "config.MONITOR.EVERY_EPOCHS=1", f"config.OPTIMIZER.num_epochs={epochs}",
        f"config.CHECKPOINT.DIR={run_dir}", *extra,
    ]  # fmt: skip
    out = subprocess.run(cmd, capture_output=True, text=True)
    if out.returncode != 0:  # said, and the next demo is timed
        print(f"{config} failed (exit {out.returncode}):\n{(out.stdout + out.stderr)[-2000:]}", flush=True)
        return []
    lines = Path(run_dir, "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if "monitor_seconds" in r]


def smallest_every(ratio: float, budget: float) -> int:
    """The smallest N with pass / (N x epoch + pass) <= budget, ``ratio`` = pass / epoch."""
    return max(1, math.ceil(ratio * (1 - budget) / budget - 1e-12))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--demos", nargs="+", default=["regnet_fsdp", "pretrain/dino_vit_demo"])
    parser.add_argument("--budget", type=float, default=0.05, help="the share the monitor may take")
    parser.add_argument(
        "--set", nargs="*", default=[], help="more overrides (config.KEY=VALUE) for every demo"
    )
    args = parser.parse_args()
    if args.demos == ["all"]:  # the quick start and every demo recipe
        demos = sorted(path.stem for path in (REPO / "configs" / "pretrain").glob("*_demo.yaml"))
        args.demos = ["regnet_fsdp"] + [f"pretrain/{name}" for name in demos]
    for config in args.demos:
        with tempfile.TemporaryDirectory() as tmp:
            records = monitor_records(config, args.epochs, Path(tmp) / "run", args.set)
        if not records:
            continue
        print(f"{config}: {args.epochs} epochs, a monitor pass after each")
        for r in records:
            knn = f"knn_top1 {r['knn_top1']:.2f}  " if "knn_top1" in r else ""
            print(
                f"  epoch {r['epoch'] + 1}: {knn}rankme {r['rankme']:.2f}  feature_std {r['feature_std']:.4f}  "
                f"pass {r['monitor_seconds']:.2f} s  epoch {r['train_seconds']:.2f} s"
            )
        steady = records[1:] or records
        ratio = statistics.median(r["monitor_seconds"] / r["train_seconds"] for r in steady)
        shares = "  ".join(f"N={n}: {ratio / (n + ratio):.1%}" for n in (1, 2, 3, 5, 10))
        print(f"  median pass / epoch {ratio:.3f}; share of the training time every N epochs: {shares}")
        every = smallest_every(ratio, args.budget)
        print(
            f"  smallest MONITOR.EVERY_EPOCHS within {args.budget:.0%}: {every} ({ratio / (every + ratio):.1%})"
        )


if __name__ == "__main__":
    main()
