"""Prints the quick start's losses and loss scales in fp16 (engine and DDP) beside fp32.

The quick start in fp16 on the CPU ranks: the engine against DDP, fp16 against fp32, and an
initial loss scale that overflows (``tools/run_distributed.py``, one run after the other).

    python dev/bench/fp16_quick_start.py [--epochs 2] [--huge-epochs 4]

Runs ``config=regnet_fsdp`` in fp32, then with ``MODEL.AMP_PARAMS.AMP_DTYPE=float16`` under the
engine and under DDP (``AUTO_SETUP_FSDP=False``) at the default ``INIT_SCALE`` (65536), and both
again at ``INIT_SCALE`` 2^40 for ``--huge-epochs``. Prints per iteration each run's loss, loss
scale and skipped steps, and the worst relative loss differences: engine vs DDP, fp16 vs fp32.
"""

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
FP16 = ["config.MODEL.AMP_PARAMS.USE_AMP=True", "config.MODEL.AMP_PARAMS.AMP_DTYPE=float16"]
DDP = ["config.MODEL.FSDP_CONFIG.AUTO_SETUP_FSDP=False"]
HUGE = ["config.MODEL.AMP_PARAMS.INIT_SCALE=1099511627776.0"]


def run(run_dir: Path, epochs: int, *overrides) -> list:
    cmd = [sys.executable, str(REPO / "tools" / "run_distributed.py"), "config=regnet_fsdp"]
    args = [
        f"config.CHECKPOINT.DIR={run_dir}",
        f"config.OPTIMIZER.num_epochs={epochs}",
        "config.LOG_FREQUENCY=1",
    ]
    out = subprocess.run([*cmd, *args, *overrides], capture_output=True, text=True)
    if out.returncode != 0:
        raise SystemExit(
            f"run failed (exit {out.returncode}): {overrides}\n{(out.stdout + out.stderr)[-4000:]}"
        )
    records = map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
    return [r for r in records if "loss" in r]  # the training's records, not the monitor's


def rel(a: float, b: float) -> float:
    return abs(a - b) / abs(b)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--huge-epochs", type=int, default=4)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        base = Path(tmp)
        runs = {
            "fp32": run(base / "fp32", args.epochs),
            "engine fp16": run(base / "engine", args.epochs, *FP16),
            "ddp fp16": run(base / "ddp", args.epochs, *FP16, *DDP),
            "engine 2^40": run(base / "engine_huge", args.huge_epochs, *FP16, *HUGE),
            "ddp 2^40": run(base / "ddp_huge", args.huge_epochs, *FP16, *DDP, *HUGE),
        }
    for name, rows in runs.items():
        print(f"{name}:")
        for row in rows:
            scale = (
                f"  scale {row['loss_scale']:g}  skipped {row['skipped_steps']}"
                if "loss_scale" in row
                else ""
            )
            print(f"  it {row['iteration']:3d}  loss {row['loss']:.5f}{scale}")
    for a, b in (("engine fp16", "ddp fp16"), ("engine 2^40", "ddp 2^40"), ("engine fp16", "fp32")):
        pairs = list(zip(runs[a], runs[b]))
        worst = max(rel(x["loss"], y["loss"]) for x, y in pairs)
        first = max(rel(x["loss"], y["loss"]) for x, y in pairs[:5])
        same = [x.get("skipped_steps") for x, _ in pairs] == [y.get("skipped_steps") for _, y in pairs]
        print(
            f"{a} vs {b}: worst relative loss difference {worst:.2e} (first 5 iterations {first:.2e}); same skipped steps: {same}"
        )
    skipped = runs["engine 2^40"][-1]["skipped_steps"]
    print(
        f"2^40: {skipped} steps skipped on every rank, final scale {runs['engine 2^40'][-1]['loss_scale']:g}"
    )


if __name__ == "__main__":
    main()
