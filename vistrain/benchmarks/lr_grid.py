"""Choosing the linear probe's learning rate without looking at the test set (``BENCHMARK.LINEAR_LRS``).

Like dinov2's linear evaluation, a grid of learning rates is trained in one pass (every head sees
the same frozen features; only its learning rate differs). Unlike a grid scored on the validation
set, the choice here is made on a held-out part of the TRAIN split (``LINEAR_HOLDOUT_FRACTION``,
stratified by label), so the reported test accuracy is not tuned on the test images. The chosen
learning rate of every feature is then retrained on the whole TRAIN split.
"""

from typing import Dict, List, Sequence, Tuple

import numpy as np


def holdout_split(labels: Sequence[int], fraction: float, seed: int) -> Tuple[List[int], List[int]]:
    """Stratified split of sample indices into (fit, holdout), both sorted.

    Every class keeps ``round(fraction * count)`` of its samples for the holdout, chosen by a
    permutation seeded with ``seed`` (the same on every rank), but never all of them and at
    least one when the class has two or more samples. Raises when the holdout would be empty.
    """
    if not 0 < fraction < 1:
        raise ValueError(f"BENCHMARK.LINEAR_HOLDOUT_FRACTION must be in (0, 1), got {fraction}")
    labels = np.asarray(labels)
    rng = np.random.RandomState(seed)
    holdout = []
    for label in np.unique(labels):
        members = np.flatnonzero(labels == label)
        count = len(members)
        take = min(count - 1, max(1 if count > 1 else 0, int(round(fraction * count))))
        holdout += rng.permutation(members)[:take].tolist()
    if not holdout:
        raise ValueError("the held-out part of DATA.TRAIN is empty: too few images per class")
    fit = sorted(set(range(len(labels))) - set(holdout))
    return fit, sorted(holdout)


def grid_key(feature: str, index: int) -> str:
    """Module-name-safe key of the head for ``feature`` at learning rate number ``index``."""
    return f"{feature}_lr{index}"


def choose_learning_rates(
    holdout_top1: Dict[str, float], features: Sequence[str], lrs: Sequence[float]
) -> Dict[str, float]:
    """{feature: the lr whose head scored best on the holdout}; ties go to the smaller lr."""
    chosen = {}
    for feature in features:
        scores = [(holdout_top1[grid_key(feature, i)], -lr, lr) for i, lr in enumerate(lrs)]
        chosen[feature] = max(scores)[2]
    return chosen
