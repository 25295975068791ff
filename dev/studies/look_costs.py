"""Prints what tools/look.py costs and finds on a run folder: seconds (wall and CPU) to embed and
to draw each picture at several sample caps, the near-duplicate pairs at several thresholds, and
the labels of the least typical images (the top of outliers.csv) beside the sample's.

    python dev/studies/look_costs.py RUN_FOLDER [--caps 500 1000 2000] [config.KEY=VALUE ...]

Pictures go to a temporary folder; nothing is written in RUN_FOLDER. docs/look.md quotes it.
"""

import argparse
import os
import tempfile
import time
from collections import Counter

import torch

from vistrain.benchmarks import look
from vistrain.benchmarks.look import similarity

THRESHOLDS = (0.9, 0.95, 0.97, 0.98, 0.99, 0.995)


def _cpu() -> float:
    times = os.times()
    return times.user + times.system


def _timed(what: str, fn):
    wall, cpu = time.perf_counter(), _cpu()
    out = fn()
    print(f"  {what:<12} {time.perf_counter() - wall:7.2f} s wall  {_cpu() - cpu:7.2f} s CPU")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("run_dir")
    parser.add_argument("--caps", type=int, nargs="+", default=[500, 1000, 2000])
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    print(f"torch threads: {torch.get_num_threads()}")
    with tempfile.TemporaryDirectory() as out:
        for cap in args.caps:
            items = [*args.overrides, f"config.LOOK.MAX_IMAGES={cap}", f"config.LOOK.OUTPUT_DIR={out}"]
            cfg = look.run_config(args.run_dir, items)
            seen = _timed(f"embed {cap}", lambda: look.Look(cfg))  # noqa: B023  (called at once)
            print(f"{len(seen.sample.paths)} images (cap {cap}), feature {cfg.LOOK.FEATURE}:")
            for name in look.PICTURES:
                _timed(name, lambda: seen.draw([name]))  # noqa: B023
            unit = similarity.unit_rows(seen.sample.features)
            counts = [len(similarity.similar_pairs(unit, t, 10**9)[0]) for t in THRESHOLDS]
            print("  pairs at similarity >= " + ", ".join(f"{t:g}: {c}" for t, c in zip(THRESHOLDS, counts)))
            order = similarity.outlier_scores(unit, cfg.LOOK.OUTLIER_K).argsort()
            for top in (32, 100):
                print(f"  labels of the {top} least typical: {_counts(seen.sample, order[:top])}")
            print(f"  labels of the sample: {_counts(seen.sample, order)}")


def _counts(sample, rows) -> str:
    """ "name: count" of each label among ``rows``, most frequent first."""
    names = Counter(sample.label(int(r)) or "unlabelled" for r in rows)
    return ", ".join(f"{name}: {count}" for name, count in names.most_common())


if __name__ == "__main__":
    main()
