"""Prints per demo the monitor's kNN of the trunk before training, the bar a run must pass and each
pass's kNN top-1 and online-probe top-1, with the "no better than before training" verdict and
the warning line when it is told.

Each recipe runs as shipped (2 ranks, its own MONITOR.EVERY_EPOCHS, its full schedule) into a
temporary folder and is stopped (SIGTERM: it saves and stops at the next boundary) once a pass
after ``--until`` of its epochs is recorded in its metrics.jsonl (1: the whole run); the verdict
is the monitor's own (``no_better_than_baseline`` in each record: from the second pass and half of
the run on; the warning is told on two such passes in a row).

    python dev/studies/monitor_baselines.py [--until 1.0] [--demos regnet_fsdp pretrain/lejepa_regnet_demo | all]
        [--set config.KEY=VALUE ...]
"""

import argparse
import json
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from vistrain.methods import load_config  # noqa: E402
from vistrain.training.monitor_rules import BASELINE, baseline_margin  # noqa: E402


def records(run_dir: Path) -> list:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def run_until(config: str, run_dir: Path, epochs: float, extra) -> list:
    """The monitor's records of ``config`` run into ``run_dir`` until a pass after ``epochs`` epochs
    (or its end)."""
    cmd = [sys.executable, str(REPO / "tools" / "run_distributed.py"), f"config={config}",
           f"config.CHECKPOINT.DIR={run_dir}", *extra]  # fmt: skip
    with open(run_dir.parent / "out.txt", "w") as log:
        process = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        while process.poll() is None:
            time.sleep(2)
            if any(r["epoch"] + 1 >= epochs for r in records(run_dir) if "rankme" in r):
                process.send_signal(signal.SIGTERM)  # the launcher stops its ranks at a boundary
                process.wait()
    return [r for r in records(run_dir) if "rankme" in r or BASELINE in r]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--until", type=float, default=1.0, help="the part of each run to watch")
    parser.add_argument("--demos", nargs="+", default=["all"])
    parser.add_argument("--set", nargs="*", default=[], help="more overrides (config.KEY=VALUE)")
    args = parser.parse_args()
    if args.demos == ["all"]:
        demos = sorted(path.stem for path in (REPO / "configs" / "pretrain").glob("*_demo.yaml"))
        args.demos = ["regnet_fsdp"] + [f"pretrain/{name}" for name in demos]
    for config in args.demos:
        with tempfile.TemporaryDirectory() as tmp:
            epochs = args.until * load_config([f"config={config}", *args.set]).OPTIMIZER.num_epochs
            found = run_until(config, Path(tmp) / "run", epochs, args.set)
            out = (Path(tmp) / "out.txt").read_text()
        base = [r for r in found if BASELINE in r]
        if not base:
            print(f"{config}: no baseline (monitor off, or no kNN)\n{out[-500:]}", flush=True)
            continue
        baseline, images = base[-1][BASELINE], base[-1]["knn_images"]
        margin = baseline_margin(baseline, images)
        lines = [line for line in out.splitlines() if "learns no better" in line]
        told = f"told:\n    {lines[0]}" if lines else "not told"
        print(
            f"{config}: before training {baseline:.2f}% on {images} images, bar {baseline + margin:.2f}%; {told}"
        )
        for r in found:
            if "rankme" in r:
                probe = f"  probe_top1 {r['probe_top1']:.2f}" if "probe_top1" in r else ""
                print(f"  epoch {r['epoch'] + 1}: knn_top1 {r['knn_top1']:.2f}{probe}  "
                      f"no_better {r.get('no_better_than_baseline')}")  # fmt: skip
        sys.stdout.flush()


if __name__ == "__main__":
    main()
