"""Prints a recipe's wall time, img/s and data share from this tree beside an earlier commit's.

The two trees' runs alternate, side by side (the earlier commit by default: the views made one PIL
image at a time).

    python dev/bench/bench_views.py                          # the quick start as shipped, one round
    python dev/bench/bench_views.py --recipe pretrain/simclr_regnet_elpv --epochs 3 --rounds 2
    python dev/bench/bench_views.py --before 8d05dae         # the default: views made one PIL image at a time

Extracts ``--before`` with ``git archive`` into a temporary folder, then runs
``tools/run_distributed.py config=<recipe>`` from that tree and from this one, alternately (the
order rotates each round), each in a fresh run folder, with its own tree first on PYTHONPATH.
Prints per tree and round: the command's wall time, the run's img/s overall (its last line), the
data share (the wait for batches over the wall time, ``data_share`` of metrics.jsonl: the mean over
the logging windows after the first epoch, and the largest), and the final loss; then the medians
over rounds and the ratios of this tree to ``--before``. The machine may be shared: read the ratios,
measured side by side, more than the values.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
BEFORE = "8d05dae"  # the last commit that made the views one PIL image at a time, in the ranks


def extract(ref: str, folder: Path) -> Path:
    """The tree of commit ``ref`` in ``folder`` (``git archive``: the repository is left as it is)."""
    archive = folder / "tree.tar"
    subprocess.run(["git", "-C", str(REPO), "archive", "-o", str(archive), ref], check=True)
    tree = folder / "before"
    with tarfile.open(archive) as tar:
        tar.extractall(tree, filter="data")
    return tree


def run(tree: Path, recipe: str, overrides, run_dir: Path) -> dict:
    """One run of the recipe from ``tree``: wall s, img/s overall, data share (mean, max), final loss."""
    env = {**os.environ, "PYTHONPATH": str(tree)}
    command = [sys.executable, str(tree / "tools" / "run_distributed.py"), f"config={recipe}", *overrides]
    start = time.monotonic()
    out = subprocess.run(
        [*command, f"config.CHECKPOINT.DIR={run_dir}"], cwd=tree, env=env, capture_output=True, text=True
    )
    wall = time.monotonic() - start
    if out.returncode != 0:
        raise SystemExit(
            f"run failed (exit {out.returncode}) from {tree}:\n{(out.stdout + out.stderr)[-4000:]}"
        )
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    records = [r for r in records if "loss" in r]  # the training's records, not the monitor's
    first_epoch_done = [r for r in records if r.get("epoch", 0) >= 1] or records
    shares = [r["data_share"] for r in first_epoch_done]
    done = [line for line in (out.stdout + out.stderr).splitlines() if "img/s overall" in line][-1]
    return {
        "wall_s": wall,
        "img_per_s": float(done.split(" img/s overall")[0].rsplit(" ", 1)[-1]),
        "data_share": statistics.mean(shares),
        "data_share_max": max(shares),
        "final_loss": records[-1]["loss"],
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--recipe", default="regnet_fsdp", help="config= of the runs (default: the quick start)"
    )
    parser.add_argument("--before", default=BEFORE, help="the commit to compare with (default %(default)s)")
    parser.add_argument("--epochs", type=int, default=0, help="OPTIMIZER.num_epochs (0: the recipe's)")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("overrides", nargs="*", help="more config.A.B=value overrides, for both trees")
    args = parser.parse_args()
    overrides = list(args.overrides) + ([f"config.OPTIMIZER.num_epochs={args.epochs}"] if args.epochs else [])
    results = {"before": [], "this tree": []}
    with tempfile.TemporaryDirectory() as scratch:
        trees = {"before": extract(args.before, Path(scratch)), "this tree": REPO}
        for r in range(args.rounds):
            for name in list(trees)[r % 2 :] + list(trees)[: r % 2]:
                result = run(
                    trees[name], args.recipe, overrides, Path(scratch, f"{name}-{r}".replace(" ", "_"))
                )
                results[name].append(result)
                print(f"round {r + 1} {name:<10} {_line(result)}", flush=True)
    print(f"{args.recipe} {' '.join(overrides)}, median of {args.rounds} round(s); before = {args.before}:")
    medians = {name: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for name, rs in results.items()}
    for name, median in medians.items():
        print(f"  {name:<10} {_line(median)}")
    before, after = medians["before"], medians["this tree"]
    print(
        f"  this tree / before: wall {after['wall_s'] / before['wall_s']:.2f}x, "
        f"img/s {after['img_per_s'] / before['img_per_s']:.2f}x"
    )


def _line(result: dict) -> str:
    return (
        f"wall {result['wall_s']:7.1f} s  {result['img_per_s']:7.1f} img/s  data share "
        f"{result['data_share']:6.1%} (max {result['data_share_max']:6.1%})  final loss {result['final_loss']:.4f}"
    )


if __name__ == "__main__":
    main()
