"""Prints the shipped evaluations at 1% and 10% of the labels: top-1, images, iterations, time, and the log's notes.

The digits' linear probe, kNN and fine-tuning (``benchmark/linear_eval_regnet``, ``knn_regnet``,
``finetune_regnet``) on the trunk of ``--digits-weights`` (a quick-start run folder), and ELPV's
(``benchmark/linear_eval_elpv``, ``finetune_elpv``) on ``--elpv-weights`` (none: the random trunk,
the control), each with ``DATA.TRAIN.LABEL_FRACTION`` 0.1 and 0.01, through the normal launcher on
the recipes' ranks, one after the other, into ``--out/frac_<engine>_<data>_<percent>``. A run
whose ``metrics.json`` is there is read, not run again. Per run: the test top-1 of the feature
picked without the test images (kNN: each feature's), the labelled images, the iterations, the
seconds, and the notes the log gives when few labels fitted the batch or changed how lr and
feature are chosen.

    python dev/studies/label_fraction_runs.py --digits-weights checkpoints/regnet_fsdp --out /tmp/fractions
"""

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
RUNS = [  # (engine, data, recipe, weights argument)
    ("linear", "digits", "benchmark/linear_eval_regnet", "digits_weights"),
    ("knn", "digits", "benchmark/knn_regnet", "digits_weights"),
    ("finetune", "digits", "benchmark/finetune_regnet", "digits_weights"),
    ("linear", "elpv", "benchmark/linear_eval_elpv", "elpv_weights"),
    ("finetune", "elpv", "benchmark/finetune_elpv", "elpv_weights"),
]
NOTES = ("few labelled images", "no class has two labelled images")


def run_once(folder: Path, argv) -> float:
    """Run the command unless ``folder`` holds its metrics.json; its wall seconds (0: read)."""
    if (folder / "metrics.json").exists():
        return 0.0
    start = time.perf_counter()
    with open(f"{folder}.out", "w") as out:
        done = subprocess.run(
            [
                sys.executable,
                str(REPO / "tools" / "run_distributed.py"),
                *argv,
                f"config.CHECKPOINT.DIR={folder}",
            ],
            cwd=REPO,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    if done.returncode != 0:
        raise SystemExit(f"{folder}: exit {done.returncode}, see {folder}.out")
    return time.perf_counter() - start


def summary(folder: Path) -> str:
    record = json.loads((folder / "metrics.json").read_text())
    if record["engine"] == "knn":
        scores = ", ".join(f"{name} {res['top1']:.2f}%" for name, res in record["results"].items())
    else:
        picked = record["picked"]
        grouped = "".join(f", {k[5:]} {v:.2f}%" for k, v in picked.items() if k.startswith("top1_"))
        scores = f"{picked['feature']} {picked['top1']:.2f}%{grouped}"
    iterations = f", {record['iterations']} iterations" if "iterations" in record else ""
    return (
        f"{record['num_train_images']} labelled images{iterations}, {record['total_seconds']:.0f} s: {scores}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--digits-weights", required=True, help="a quick-start run folder (regnet_fsdp)")
    parser.add_argument(
        "--elpv-weights", default="", help="a simclr_regnet_elpv run folder (default: random trunk)"
    )
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    for fraction, percent in ((0.1, 10), (0.01, 1)):
        for engine, data, recipe, weights in RUNS:
            folder = args.out / f"frac_{engine}_{data}_{percent}"
            argv = [f"config={recipe}", f"config.DATA.TRAIN.LABEL_FRACTION={fraction}"]
            if getattr(args, weights):
                argv.append(f"config.MODEL.WEIGHTS_INIT.PARAMS_FILE={getattr(args, weights)}")
            run_once(folder, argv)
            print(f"{engine} {data} {percent}%: {summary(folder)}")
            for line in (folder / "log.txt").read_text().splitlines():
                if any(note in line for note in NOTES):
                    print(f"    {line.split('] ', 1)[1]}")


if __name__ == "__main__":
    main()
