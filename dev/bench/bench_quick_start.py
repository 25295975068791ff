"""Prints the quick start's images/s: DDP, auto-tuned, the auto-tuner's choice by hand, defaults.

The quick start's throughput: DDP, auto-tuned (as shipped), the auto-tuner's choice set by hand, and
the engine's defaults without auto-tune, alternating runs of ``tools/run_distributed.py``.

    python dev/bench/bench_quick_start.py [--rounds 3] [--epochs 3]

Each round runs every variant once, one after the other, in fresh run folders (each rank gets
cores / ranks threads, as any run). Prints per variant the median over rounds of the images/s
the run reports overall (``done in ...: ... img/s overall``) and its ratio to DDP's, the
auto-tuner's line, and whether the hand-set run logged the same losses as the tuned one.
"""

import argparse
import json
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

from vistrain.config.checks import get_key
from vistrain.planner.knobs import EXACT_KNOBS, overrides

REPO = Path(__file__).resolve().parents[2]
OVERALL = re.compile(r"([\d.]+) img/s overall")


def run(args, run_dir):
    cmd = [sys.executable, str(REPO / "tools" / "run_distributed.py"), "config=regnet_fsdp", *args]
    out = subprocess.run([*cmd, f"config.CHECKPOINT.DIR={run_dir}"], capture_output=True, text=True)
    if out.returncode != 0:  # the whole log: a rank's abort says little on stderr alone
        raise SystemExit(
            f"run failed (exit {out.returncode}): {' '.join(args)}\n{(out.stdout + out.stderr)[-4000:]}"
        )
    text = out.stdout + out.stderr
    records = map(json.loads, Path(run_dir, "metrics.jsonl").read_text().splitlines())
    losses = [r["loss"] for r in records if "loss" in r]  # the monitor's records carry none
    tune_line = next((line for line in text.splitlines() if "auto-tune:" in line), "")
    return float(OVERALL.findall(text)[-1]), losses, tune_line


def chosen_overrides(run_dir):
    """The tuned run's knobs from its config.yaml, as overrides (auto-tune off)."""
    recorded = yaml.safe_load(Path(run_dir, "config.yaml").read_text())
    knobs = {name: get_key(recorded, key) for name, key in EXACT_KNOBS.items()}
    return ["config.MODEL.FSDP_CONFIG.AUTO_TUNE=False", *overrides(knobs)[1:]]  # [0]: AUTO_SETUP_FSDP


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--epochs", type=int, default=3)
    args = parser.parse_args()
    epochs = [f"config.OPTIMIZER.num_epochs={args.epochs}"]
    variants = {
        "ddp": [
            *epochs,
            "config.MODEL.FSDP_CONFIG.AUTO_SETUP_FSDP=False",
            "config.MODEL.FSDP_CONFIG.AUTO_TUNE=False",
        ],
        "auto-tuned (shipped)": epochs,
        "chosen knobs by hand": None,  # filled after the first tuned run
        "defaults, no auto-tune": [*epochs, "config.MODEL.FSDP_CONFIG.AUTO_TUNE=False"],
    }
    speeds = {name: [] for name in variants}
    losses, tune_line = {}, ""
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            for i, (name, overrides) in enumerate(variants.items()):
                run_dir = Path(tmp, f"{r}-{i}")
                if overrides is None:
                    overrides = variants[name] = [*epochs, *chosen_overrides(Path(tmp, f"{r}-1"))]
                speed, losses[name], line = run(overrides, run_dir)
                tune_line = line or tune_line
                speeds[name].append(speed)
                print(f"round {r + 1} {name:<24} {speed:7.1f} img/s", flush=True)
    ddp = statistics.median(speeds["ddp"])
    print(f"quick start, {args.epochs} epochs, median of {args.rounds} rounds (img/s overall):")
    for name, values in speeds.items():
        median = statistics.median(values)
        print(f"  {name:<24} {median:7.1f} img/s  DDP / this {ddp / median:5.2f}x")
    print(f"  {tune_line.split('] ', 1)[-1]}")
    same = losses["auto-tuned (shipped)"] == losses["chosen knobs by hand"]
    print(f"  auto-tuned vs the same knobs by hand: {'identical' if same else 'DIFFERENT'} losses")


if __name__ == "__main__":
    main()
