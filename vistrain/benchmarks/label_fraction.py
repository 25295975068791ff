"""Label fractions: evaluate with a few of the labels (``DATA.TRAIN.LABEL_FRACTION``).

The semi-supervised protocol of SimCLR (Chen et al. 2020, sec. 6.2) and BYOL: the linear probe, kNN
or fine-tuning sees the labels of only 1% or 10% of the TRAIN split, drawn per class, and is scored
on the whole TEST split as usual. It answers the question a user with many unlabelled and few
labelled images asks: does pretraining on the unlabelled ones help when labels are few?

:func:`label_subset` is the pure rule: every class c of the labelled TRAIN images keeps
``max(1, round(f * n_c))`` of its n_c images (rounded half up), drawn by a permutation of the class
seeded with (``LABEL_SUBSET_SEED``, c) alone. So the subset is

* stratified: the classes keep their proportions (and no class disappears);
* repeatable: the same on every rank, every run and every world size, whatever order the images
  are listed in; a smaller fraction's images are among a larger one's (1% within 10%);
* disjoint from DATA.TEST by construction: it is drawn from DATA.TRAIN's images only.

The images outside the subset are not used by the evaluation at all (BatchNorm statistics
recomputed with ``BENCHMARK.TRUNK_BN_STATS: recompute`` still use every TRAIN image: they need no
labels).
"""

import math
from typing import List, Optional, Sequence

import numpy as np
import torch

from vistrain.benchmarks import common
from vistrain.config.words import plural
from vistrain.data import build_loader
from vistrain.runtime.logger import logger


def label_subset(indices: Sequence[int], labels: Sequence[int], fraction: float, seed: int) -> List[int]:
    """The labelled images an evaluation may use: a sorted subset of ``indices``.

    Args:
        indices: (N,) distinct sample indices of the labelled TRAIN split.
        labels: (N,) their classes, >= 0.
        fraction: f in (0, 1]; 1 keeps every index.
        seed: >= 0; with the class, it alone seeds the class's draw.
    Returns:
        For every class c with n_c images, ``min(n_c, max(1, floor(f * n_c + 1/2)))`` of its
        indices: the first ones of a permutation of the class's sorted indices drawn from
        ``numpy.random.default_rng([seed, c])``; all classes together, sorted.
    """
    if not 0 < fraction <= 1:
        raise ValueError(f"DATA.TRAIN.LABEL_FRACTION must be in (0, 1], got {fraction}")
    if seed < 0:
        raise ValueError(f"DATA.TRAIN.LABEL_SUBSET_SEED must be >= 0, got {seed}")
    indices, labels = np.asarray(indices, dtype=np.int64), np.asarray(labels, dtype=np.int64)
    if indices.shape != labels.shape or len(np.unique(indices)) != len(indices):
        raise ValueError(
            f"need one label per distinct index, got {len(indices)} indices and {len(labels)} labels"
        )
    if (labels < 0).any():
        raise ValueError("label_subset takes labelled images only (labels >= 0)")
    kept: List[int] = []
    for label in np.unique(labels):
        members = np.sort(indices[labels == label])
        take = min(len(members), max(1, math.floor(fraction * len(members) + 0.5)))
        order = np.random.default_rng([int(seed), int(label)]).permutation(len(members))
        kept += members[order[:take]].tolist()
    return sorted(kept)


def labelled_train_loader(cfg, device: torch.device, labels: Optional[Sequence[int]] = None):
    """(the loader of the TRAIN images an evaluation trains on, their data set indices or None
    for all of them). With ``DATA.TRAIN.LABEL_FRACTION`` < 1 the loader reads the
    :func:`label_subset` of DATA.TRAIN only; ``labels``: DATA.TRAIN's (else read from its data set)."""
    train_cfg = cfg.DATA.TRAIN
    loader = build_loader(cfg.DATA, "TRAIN", seed=cfg.SEED_VALUE, device=device)
    if train_cfg.LABEL_FRACTION >= 1:
        return loader, None
    common.check_labels(loader.dataset, "TRAIN")
    labels = loader.dataset.targets if labels is None else labels
    subset = label_subset(range(len(labels)), labels, train_cfg.LABEL_FRACTION, train_cfg.LABEL_SUBSET_SEED)
    logger.info(
        f"DATA.TRAIN.LABEL_FRACTION {train_cfg.LABEL_FRACTION:g}: {plural(len(subset), 'labelled image')} "
        f"of {len(labels)} (stratified, LABEL_SUBSET_SEED {train_cfg.LABEL_SUBSET_SEED})"
    )
    return build_loader(cfg.DATA, "TRAIN", seed=cfg.SEED_VALUE, device=device, indices=subset), subset


def in_data_set(positions: Sequence[int], subset: Optional[Sequence[int]]) -> List[int]:
    """Data set indices of ``positions`` in the subset's order (``subset`` None: the positions)."""
    return list(positions) if subset is None else [int(subset[i]) for i in positions]


def record(cfg, num_train_images: int) -> dict:
    """What metrics.json says about the labels used."""
    return {
        "label_fraction": float(cfg.DATA.TRAIN.LABEL_FRACTION),
        "label_subset_seed": int(cfg.DATA.TRAIN.LABEL_SUBSET_SEED),
        "num_train_images": int(num_train_images),
    }
