"""scikit-learn's digits and the demo's split, read in a process of their own.

Importing scikit-learn (and SciPy with it) adds about 77 MiB of anonymous memory that a training
rank would keep to its end: the first quick start on a fresh cache then peaked 580 MiB per rank
against the planner's 509 (503 once the cache exists). ``read_digits`` therefore runs this file
in a child process, which imports only NumPy and scikit-learn, and reads back the
arrays it saved. Nothing here imports vistrain or torch.
"""

import os
import subprocess
import sys
import tempfile

import numpy as np

VAL_FRACTION = 0.2
SPLIT_SEED = 0


def split_ids(labels: np.ndarray) -> dict:
    """{"train": ids, "val": ids} of ``load_digits()`` samples: the demo's stratified 80/20 split
    (``train_test_split(..., stratify=labels, random_state=SPLIT_SEED)``)."""
    from sklearn.model_selection import train_test_split

    ids = np.arange(len(labels))
    train, val = train_test_split(ids, test_size=VAL_FRACTION, stratify=labels, random_state=SPLIT_SEED)
    return {"train": sorted(train.tolist()), "val": sorted(val.tolist())}


def _save_digits(path: str) -> None:
    """Save images (1797, 8, 8) float grey levels 0..16, labels (1797,) and both splits' ids."""
    from sklearn.datasets import load_digits

    digits = load_digits()  # ships with scikit-learn: no download
    splits = split_ids(digits.target)
    np.savez(path, images=digits.images, labels=digits.target, train=splits["train"], val=splits["val"])


def read_digits():
    """(images (N, 8, 8), labels (N,), {"train": ids, "val": ids}), computed in a child process."""
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "digits.npz")
        # run_path, not "python this_file.py": that would put vistrain/data (datasets.py,
        # transforms.py, ...) first on the child's import path
        run = "import runpy, sys; runpy.run_path(sys.argv[1], run_name='__main__')"
        command = [sys.executable, "-c", run, os.path.abspath(__file__), path]
        child = subprocess.run(command, capture_output=True, text=True)
        if child.returncode != 0:
            last = (child.stderr.strip().splitlines() or ["no output"])[-1]
            raise RuntimeError(f"reading scikit-learn's digits failed: {last}")
        with np.load(path, allow_pickle=False) as saved:
            splits = {split: saved[split].tolist() for split in ("train", "val")}
            return saved["images"], saved["labels"], splits


if __name__ == "__main__":
    _save_digits(sys.argv[-1])
