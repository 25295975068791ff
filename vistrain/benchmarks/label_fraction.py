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

Few labels need smaller batches: under ``DROP_LAST`` a training pass over fewer images than one
global batch would have no batch at all. :func:`fit_batch` is the rule, :class:`BatchFit` applies
it to every training pass of a job (the final fit, each cross-validation fold's fit part) and
says so in one log line; the epochs are kept.
"""

import math
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch

from vistrain.benchmarks import common
from vistrain.config import ConfigError
from vistrain.config.words import plural
from vistrain.data import build_loader
from vistrain.distributed import comm
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


def labelled_train_loader(
    cfg, device: torch.device, labels: Optional[Sequence[int]] = None, fit: Optional["BatchFit"] = None
):
    """(the loader of the TRAIN images an evaluation trains on, their data set indices or None
    for all of them). With ``DATA.TRAIN.LABEL_FRACTION`` < 1 the loader reads the
    :func:`label_subset` of DATA.TRAIN only; ``labels``: DATA.TRAIN's (else read from its data set).
    ``fit``: the job's :class:`BatchFit`, which sizes the loader's batch (the final fit's pass);
    without it the loader has DATA.TRAIN's batch."""
    train_cfg = cfg.DATA.TRAIN
    loader = build_loader(cfg.DATA, "TRAIN", seed=cfg.SEED_VALUE, device=device)
    subset = None
    if train_cfg.LABEL_FRACTION < 1:
        common.check_labels(loader.dataset, "TRAIN")
        labels = loader.dataset.targets if labels is None else labels
        fraction, seed = train_cfg.LABEL_FRACTION, train_cfg.LABEL_SUBSET_SEED
        subset = label_subset(range(len(labels)), labels, fraction, seed)
        logger.info(
            f"DATA.TRAIN.LABEL_FRACTION {fraction:g}: {plural(len(subset), 'labelled image')} "
            f"of {len(labels)} (stratified, LABEL_SUBSET_SEED {seed})"
        )
    batch = train_cfg.BATCHSIZE_PER_REPLICA
    if fit is not None:
        batch = fit.batch("the final fit", len(loader.dataset) if subset is None else len(subset))
    if subset is None and batch == train_cfg.BATCHSIZE_PER_REPLICA:
        return loader, None
    return fitted_train_loader(cfg, device, subset, batch), subset


# --------------------------------------------------------------------------------------------
# batches fitted to few images


def fit_batch(num_images: int, world_size: int, batch_size: int) -> int:
    """The per-rank batch of a training pass over ``num_images`` images under DROP_LAST.

    ``batch_size`` when one global batch fits (``num_images >= world_size * batch_size``: the
    pass is as configured); else ``num_images // world_size``: one full batch per rank, the epoch
    one iteration that leaves out fewer than ``world_size`` images (a different few each epoch
    when shuffling). ValueError when ``num_images < world_size`` (a rank would get no image).
    """
    if min(world_size, batch_size) < 1:
        raise ValueError(f"world size and batch must be >= 1, got {world_size} and {batch_size}")
    if num_images < world_size:
        raise ValueError(f"{plural(num_images, 'image')} cannot fill a batch on each of {world_size} ranks")
    return min(batch_size, num_images // world_size)


class BatchFit:
    """The per-rank batch of every training pass of one evaluation job, each fitted to its images
    by :func:`fit_batch` (without ``DROP_LAST`` the configured batch: the sampler pads instead),
    and the one log line that says which passes got a smaller batch."""

    def __init__(self, batch_size: int, world_size: int, drop_last: bool):
        self.batch_size, self.world_size, self.drop_last = batch_size, world_size, drop_last
        self.passes: Dict[str, List[Tuple[int, int]]] = {}  # what -> [(images, batch)] in order

    def batch(self, what: str, num_images: int) -> int:
        """The batch of a pass ``what`` ("the final fit", "the fit parts") over ``num_images``;
        ConfigError (one line) when the ranks outnumber the images."""
        batch = self.batch_size
        if self.drop_last:
            try:
                batch = fit_batch(num_images, self.world_size, self.batch_size)
            except ValueError as error:
                raise ConfigError(
                    f"{what} of DATA.TRAIN: {error}; raise DATA.TRAIN.LABEL_FRACTION or use fewer ranks"
                ) from None
        self.passes.setdefault(what, []).append((num_images, batch))
        return batch

    def note(self) -> Optional[str]:
        """One line giving every pass's batch once some pass's was fitted (None while none was)."""
        if all(batch == self.batch_size for runs in self.passes.values() for _, batch in runs):
            return None
        parts = []
        for what, runs in self.passes.items():
            images, batches = [n for n, _ in runs], [b for _, b in runs]
            parts.append(f"{what} ({_span(images)} images) {_span(batches)}")
        return (
            f"few labelled images: a training pass over fewer than one global batch ({self.world_size} ranks x "
            f"{self.batch_size}) takes them in one batch per rank, one iteration per epoch (the epochs are "
            f"kept); batch per rank: {', '.join(parts)}"
        )


def _span(values: Sequence[int]) -> str:
    low, high = min(values), max(values)
    return f"{low}" if low == high else f"{low}-{high}"


def fitted_train_loader(cfg, device: torch.device, indices: Optional[Sequence[int]], batch: int):
    """The DATA.TRAIN loader of ``indices`` (None: every image) with ``batch`` images per rank."""
    data_cfg = cfg.DATA
    if batch != data_cfg.TRAIN.BATCHSIZE_PER_REPLICA:
        data_cfg = data_cfg.clone()
        data_cfg.defrost()
        data_cfg.TRAIN.BATCHSIZE_PER_REPLICA = batch
        data_cfg.freeze()
    return build_loader(data_cfg, "TRAIN", seed=cfg.SEED_VALUE, device=device, indices=indices)


def job_batch_fit(cfg) -> BatchFit:
    """The :class:`BatchFit` of an evaluation job of ``cfg`` on this job's ranks."""
    train = cfg.DATA.TRAIN
    return BatchFit(train.BATCHSIZE_PER_REPLICA, comm.get_world_size(), train.DROP_LAST)


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
