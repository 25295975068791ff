"""Choosing the linear probe's learning rate without looking at the test set (``BENCHMARK.LINEAR_LRS``).

Like dinov2's linear evaluation, a grid of learning rates is trained in one pass (every head sees
the same frozen features; only its learning rate differs). Unlike a grid scored on the validation
set, the choice here is made on a held-out part of the TRAIN split (``LINEAR_HOLDOUT_FRACTION``,
stratified by label), so the reported test accuracy is not tuned on the test images. With
``LINEAR_LR_FOLDS`` = k > 1 the choice is made by stratified k-fold cross-validation instead: the
grid trains k times, each time scored on a different 1/k of TRAIN, and every lr is judged by its
hits over all TRAIN images (one image is worth 1/N of a point rather than 1/(N/10): on small data
sets a single held-out part picks lrs by noise). The chosen learning rate of every feature is then
retrained on the whole TRAIN split.

Few labels (a label fraction): a held-out image whose class has no image in the fit part is wrong
for every lr, so it says nothing. :func:`lr_splits` therefore holds out only images of classes with
two or more images, and with k folds uses k' = min(k, the smallest such class) folds, so that every
class held out in a fold is also in its fit part; classes of one image stay in every fit part.
When no class has two images (1% of the digits: one per class) nothing can be held out: no lr is
chosen (``OPTIMIZER``'s lr) and the first feature is reported as picked.
"""

from collections import Counter
from typing import Dict, List, Optional, Sequence, Tuple

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


def stratified_folds(labels: Sequence[int], folds: int, seed: int) -> List[Tuple[List[int], List[int]]]:
    """Stratified k-fold split: ``folds`` pairs (fit, holdout) of sorted sample indices.

    Every class is permuted (seeded with ``seed``, the same on every rank) and dealt round-robin
    to the folds, starting where the previous class stopped so that the folds' sizes differ by at
    most one. The holdouts are disjoint and together cover every sample once; each fit part is
    the rest. Raises unless 2 <= ``folds`` <= number of samples.
    """
    labels = np.asarray(labels)
    if not 2 <= folds <= len(labels):
        raise ValueError(
            f"BENCHMARK.LINEAR_LR_FOLDS must be 1 (one holdout) or 2..{len(labels)}, got {folds}"
        )
    rng = np.random.RandomState(seed)
    holdouts: List[List[int]] = [[] for _ in range(folds)]
    dealt = 0
    for label in np.unique(labels):
        for index in rng.permutation(np.flatnonzero(labels == label)).tolist():
            holdouts[dealt % folds].append(index)
            dealt += 1
    everything = set(range(len(labels)))
    return [(sorted(everything - set(holdout)), sorted(holdout)) for holdout in holdouts]


Splits = List[Tuple[List[int], List[int]]]


def lr_splits(
    labels: Sequence[int], folds: int, holdout_fraction: float, seed: int
) -> Tuple[Splits, Optional[str]]:
    """The (fit, held-out) positions in ``labels`` that choose the lr, and a one-line note when
    few labels changed the plan (module docstring), else None.

    ``folds`` k > 1: :func:`stratified_folds` over the images of the classes with >= 2 images, with
    k' = min(k, their smallest count) folds; the images of one-image classes are added to every fit
    part. ``folds`` 1: one :func:`holdout_split` (which holds out no image of a one-image class).
    No class with 2 images: ``[]``: nothing to hold out.
    """
    labels = list(labels)
    counts = Counter(labels)
    foldable = [i for i, label in enumerate(labels) if counts[label] >= 2]
    singles = sorted(set(range(len(labels))) - set(foldable))
    if not foldable:
        return [], (
            f"no class has two labelled images ({len(labels)} images, one per class): none can be held "
            "out to choose the lr, so OPTIMIZER's lr trains"
        )
    if folds <= 1:
        return [holdout_split(labels, holdout_fraction, seed)], None
    smallest = min(counts[labels[i]] for i in foldable)
    used = min(folds, smallest)
    inner = stratified_folds([labels[i] for i in foldable], used, seed)
    splits = [
        (sorted([foldable[i] for i in fit] + singles), [foldable[i] for i in held_out])
        for fit, held_out in inner
    ]
    if used == folds and not singles:
        return splits, None
    note = f"few labelled images: the lr is chosen by {used}-fold cross-validation"
    if used < folds:
        note += f" (not {folds}: a class has only {smallest} images)"
    if singles:
        alone = (
            "1 image alone in its class is"
            if len(singles) == 1
            else f"{len(singles)} images alone in their class are"
        )
        note += f"; {alone} never held out (trained on in every fold)"
    return splits, note


def pooled_top1(per_fold: Sequence[Dict[str, dict]]) -> Dict[str, float]:
    """{head key: top-1 % over the union of the folds' holdouts}, from every fold's
    ``{head key: {"top1": %, "num_images": n}}``: hits are summed, not percentages averaged."""
    hits: Dict[str, float] = {}
    images: Dict[str, int] = {}
    for results in per_fold:
        for key, result in results.items():
            hits[key] = hits.get(key, 0.0) + round(result["top1"] * result["num_images"] / 100.0)
            images[key] = images.get(key, 0) + result["num_images"]
    return {key: 100.0 * hits[key] / max(images[key], 1) for key in hits}


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
