"""Prints whether two runs computed the same: the first differing loss and checkpoint tensor diffs.

Did two training runs compute the same thing? Compares their logged losses and, bit for bit,
their latest checkpoints.

For checks across machines and builds of torch (docs/benchmarks.md, "Across machines"): the same
recipe and seed run twice, e.g. once with the CUDA build of torch and once in the venv of
``dev/recipes/cpu_build_venv.sh``. Prints the first logged iteration whose loss differs (or that every one
agrees), and, for the most advanced checkpoint both runs hold, per rank file: how many tensors
differ and the largest absolute difference, and which entries of metadata.json differ (the torch
version, the creation time and the resolved config's run folder are expected to). Exits 1 when a
logged loss or a tensor differs.

    python dev/recipes/compare_runs.py RUN_DIR_A RUN_DIR_B
"""

import argparse
import json
import re
import sys
from pathlib import Path
from typing import Dict, List, Tuple

import torch

LOSS_LINE = re.compile(r" it (\d+)/\d+ +loss ([0-9.]+) \(avg ([0-9.]+)\)")


def logged_losses(run_dir: Path) -> List[Tuple[int, str, str]]:
    """(iteration, loss, running average) of every training line in rank 0's log.txt, as printed."""
    text = (run_dir / "log.txt").read_text()
    return [(int(it), loss, avg) for it, loss, avg in LOSS_LINE.findall(text)]


def tensors(tree, prefix: str = "") -> Dict[str, torch.Tensor]:
    """Every tensor of a loaded checkpoint file, keyed by its path in the nested dicts and lists."""
    if torch.is_tensor(tree):
        return {prefix: tree}
    items = (
        tree.items() if isinstance(tree, dict) else enumerate(tree) if isinstance(tree, (list, tuple)) else []
    )
    found = {}
    for key, value in items:
        found.update(tensors(value, f"{prefix}.{key}" if prefix else str(key)))
    return found


def latest_common_checkpoint(a: Path, b: Path) -> str:
    def complete(run: Path):
        return {p.name for p in run.glob("checkpoint_*") if (p / "metadata.json").exists()}

    common = complete(a) & complete(b)
    if not common:
        sys.exit(f"no complete checkpoint of the same iteration in both {a} and {b}")
    return max(common, key=lambda name: int(name.split("_")[1]))


def compare_checkpoints(a: Path, b: Path) -> bool:
    name = latest_common_checkpoint(a, b)
    meta_a, meta_b = (json.loads((run / name / "metadata.json").read_text()) for run in (a, b))
    keys = sorted(k for k in {*meta_a, *meta_b} if meta_a.get(k) != meta_b.get(k))
    print(f"{name}: metadata.json entries that differ: {', '.join(keys) or 'none'}")
    same = True
    for file in sorted((a / name).glob("*.pt")):
        left = tensors(torch.load(file, map_location="cpu", weights_only=True))
        right = tensors(torch.load(b / name / file.name, map_location="cpu", weights_only=True))
        shared = [k for k in left if k in right and left[k].shape == right[k].shape]
        differing = [k for k in shared if not torch.equal(left[k], right[k])]
        largest = max(
            ((left[k].double() - right[k].double()).abs().max().item() for k in differing), default=0.0
        )
        reshaped = sum(1 for k in left if k in right and left[k].shape != right[k].shape)
        unmatched = len(set(left) ^ set(right)) + reshaped
        print(
            f"  {file.name}: {len(left)} tensors, {len(differing)} differ (largest |difference| {largest:.3g}), "
            f"{unmatched} without a same-shaped counterpart"
        )
        same = same and not differing and not unmatched
    return same


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("run_a", type=Path)
    parser.add_argument("run_b", type=Path)
    args = parser.parse_args()
    losses_a, losses_b = logged_losses(args.run_a), logged_losses(args.run_b)
    first_difference = next(((x, y) for x, y in zip(losses_a, losses_b) if x != y), None)
    if first_difference is None and len(losses_a) == len(losses_b):
        print(
            f"losses: all {len(losses_a)} logged lines agree (last: it {losses_a[-1][0]}, loss {losses_a[-1][1]})"
        )
    elif first_difference is None:
        print(f"losses: the shorter log agrees (A: {len(losses_a)} lines, B: {len(losses_b)})")
    else:
        (it, loss_a, _), (_, loss_b, _) = first_difference
        print(f"losses: first difference at it {it}: {loss_a} (A) against {loss_b} (B)")
    same_checkpoints = compare_checkpoints(args.run_a, args.run_b)
    return 0 if first_difference is None and len(losses_a) == len(losses_b) and same_checkpoints else 1


if __name__ == "__main__":
    sys.exit(main())
