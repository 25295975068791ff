"""Linear evaluation of a frozen trunk, one rank: ``linear_eval(cfg)`` (``JOB: linear_eval``).

The standard protocol (Goyal et al., "Scaling and Benchmarking Self-Supervised Visual
Representation Learning", 2019, as in VISSL): the pretrained trunk is frozen and, for every
feature in ``BENCHMARK.FEATURES``, a linear classifier ``Linear(BatchNorm1d(f, affine=False))``
is trained on the pooled feature ``f`` with SGD (+ nesterov) and a step or cosine schedule. All
heads train together from one pass of the trunk per batch, so evaluating several stages costs one
trunk forward. With ``BENCHMARK.LINEAR_LRS`` each feature's learning rate is chosen on held-out
TRAIN images first, one holdout or k folds (see :mod:`vistrain.benchmarks.lr_grid`); with the
deterministic ``eval`` TRAIN transform the frozen features are computed once
(:class:`~vistrain.benchmarks.linear_heads.CachedFeatures`). With ``DATA.TRAIN.LABEL_FRACTION`` the
heads see a stratified part of TRAIN only (:mod:`vistrain.benchmarks.label_fraction`). Top-1/top-5 on ``DATA.TEST`` are written to the log, TensorBoard
(``linear_eval/<feature>/top1``) and ``CHECKPOINT.DIR/metrics.json``; the trained heads to
``CHECKPOINT.DIR/linear_heads.pt``.

Distributed: the heads are data parallel (DDP, sync BatchNorm when configured); the trunk is
either replicated or sharded by our engine (``AUTO_SETUP_FSDP``). Test counts are de-duplicated
(the sampler pads with repeats) and summed over ranks, so they are exact for any world size.
"""

import dataclasses
import os
import time
from typing import List, Optional

import torch

from vistrain.benchmarks import common, eval_pictures, label_fraction, linear_report, lr_grid
from vistrain.benchmarks.linear_heads import (
    CachedFeatures,
    FrozenFeatures,
    LinearHeads,
    cache_features,
    evaluate,
    train_heads,
)
from vistrain.config import ConfigError
from vistrain.data import build_loader
from vistrain.distributed import comm
from vistrain.fsdp import unwrap
from vistrain.runtime.logger import TrainingMeter, logger
from vistrain.runtime.parallel import parallelize
from vistrain.runtime.precision import amp_dtype
from vistrain.runtime.run_setup import record_config, start_run
from vistrain.runtime.tracking import wandb_settings

__all__ = ["CachedFeatures", "FrozenFeatures", "LinearHeads", "cache_features", "linear_eval", "train_heads"]


@dataclasses.dataclass
class _Job:
    """What linear evaluation builds before training: data, trunk features and the lr grid's passes."""

    train_loader: object  # the labelled TRAIN images trained on (a label fraction's, or all)
    test_loader: object
    subset: Optional[List[int]]  # their data set indices under a label fraction, else None
    num_classes: int
    dims: dict  # feature -> width
    source: FrozenFeatures  # the trunk's features of a batch
    train_source: object  # the same for TRAIN batches: FrozenFeatures, or CachedFeatures
    grid: List[float]  # BENCHMARK.LINEAR_LRS
    splits: list  # [(fit, held-out) data set indices of the training images]
    fit_loaders: list
    total: int  # iterations of the whole job


def linear_eval(cfg) -> None:
    """Train linear heads on the frozen trunk's features of DATA.TRAIN, evaluate on DATA.TEST."""
    start = time.perf_counter()
    device = start_run(cfg)
    job = _build(cfg, device)
    record_config(cfg)  # built and loaded: the job really starts
    tracking = wandb_settings(cfg)
    meter = TrainingMeter(
        cfg.CHECKPOINT.DIR, cfg.LOG_FREQUENCY, job.total, device, console=False, tracking=tracking
    )
    heads, (lrs, selection), iterations = _train(cfg, job, meter)
    train_seconds = time.perf_counter() - start
    groups = [list(g) for g in cfg.BENCHMARK.CLASS_GROUPS]
    tested = evaluate(job.source, heads, job.test_loader, groups)
    results = linear_report.with_choices(tested, job.dims, lrs, selection)
    record = linear_report.record(
        cfg, "linear_eval", results, {"num_classes": job.num_classes, "iterations": iterations},
        (start, train_seconds),
    )  # fmt: skip
    record.update(label_fraction.record(cfg, len(job.train_loader.dataset)))
    linear_report.report(cfg.CHECKPOINT.DIR, record, meter.writer, "linear evaluation")
    bank = job.train_source
    if not isinstance(bank, CachedFeatures):
        bank = cache_features(job.source, cfg.DATA, cfg.SEED_VALUE, job.subset)
    loaders = (job.train_loader, job.test_loader)
    picked = record["picked"]["feature"]
    for path in eval_pictures.draw(
        cfg, job.source, heads, loaders, picked, bank, job.num_classes, meter.writer, iterations
    ):
        logger.info(f"wrote {path}")
    if comm.is_main_process():
        torch.save(unwrap(heads).state_dict(), os.path.join(cfg.CHECKPOINT.DIR, "linear_heads.pt"))
    meter.summary()


def _build(cfg, device) -> _Job:
    """Loaders (TRAIN: a label fraction's images), the frozen trunk, the lr grid's passes; logs
    the header. TRAIN's features are computed once when its transform is the deterministic one."""
    fit = label_fraction.job_batch_fit(cfg)
    train_loader, subset = label_fraction.labelled_train_loader(cfg, device, fit=fit)
    test_loader = build_loader(cfg.DATA, "TEST", seed=cfg.SEED_VALUE, device=device)
    num_classes = common.num_classes(train_loader.dataset, test_loader.dataset)
    if len(train_loader) == 0:
        raise ConfigError("DATA.TRAIN yields no full batch per rank: add data or lower BATCHSIZE_PER_REPLICA")
    trunk, dims = common.build_frozen_trunk(cfg, device)
    bench = cfg.BENCHMARK
    source = FrozenFeatures(
        trunk, list(dims), bench.POOL_SIZE, amp_dtype(cfg.MODEL), device, bench.FEATURE_VIEWS
    )
    grid, (splits, fit_loaders), total, notes = _passes(cfg, train_loader, subset, device, fit)
    world = comm.get_world_size()
    logger.info(
        linear_report.header(
            source.names, dims, num_classes, cfg.OPTIMIZER.num_epochs, len(train_loader), world
        )
    )
    for note in (*notes, fit.note()):
        if note:
            logger.info(note)
    if grid:
        logger.info(linear_report.grid_plan(grid, len(splits), bench.LINEAR_HOLDOUT_FRACTION))
    train_source = source
    if cfg.DATA.TRAIN.TRANSFORMS.NAME == "eval" and not cfg.DATA.TRAIN.SKIP_CORRUPT:
        # the same features every epoch: compute them once (a skipped image would have no row)
        train_source = cache_features(source, cfg.DATA, cfg.SEED_VALUE, subset)
    return _Job(
        train_loader, test_loader, subset, num_classes, dims, source, train_source, grid, splits,
        fit_loaders, total,
    )  # fmt: skip


def _train(cfg, job: _Job, meter: TrainingMeter):
    """[Each feature's lr chosen on held-out training images], then the heads trained on all the
    training images. Returns (heads, ({feature: lr}, {feature: held-out top-1} or None), iterations)."""
    clock = linear_report.JobClock(job.total)
    lrs, selection, iterations = {}, None, 0
    if job.grid:
        sources = (job.train_source, job.source)
        lrs, selection, iterations = select_learning_rates(
            cfg, sources, job.dims, job.num_classes, job.grid, (job.splits, job.fit_loaders), (meter, clock)
        )
    heads = LinearHeads(job.dims, job.num_classes, lrs=lrs)
    heads = parallelize(heads, common.heads_model_config(cfg.MODEL), job.source.device, shard=False)
    iterations = train_heads(job.train_source, heads, job.train_loader, cfg.OPTIMIZER, meter, iterations)
    logger.info(f"final fit on DATA.TRAIN done ({clock.elapsed()})")
    return heads, (lrs, selection), iterations


def _passes(cfg, train_loader, subset, device, fit: label_fraction.BatchFit):
    """(the lr grid, ([(fit, held-out) data set indices of the training images], their fit
    loaders), the iterations of the whole job: every grid round's and the final fit's, each
    ``num_epochs`` long, [notes for the log]). ``subset``: the training images' data set indices
    (None: all of TRAIN); ``fit``: the job's batch per pass. Few labels may shrink the folds or
    leave no lr to choose (``lr_grid.lr_splits``): the grid is then empty."""
    grid = [float(lr) for lr in cfg.BENCHMARK.LINEAR_LRS]
    splits, notes = [], []
    if grid:
        bench = cfg.BENCHMARK
        positions, note = lr_grid.lr_splits(
            train_loader.dataset.targets,
            int(bench.LINEAR_LR_FOLDS),
            bench.LINEAR_HOLDOUT_FRACTION,
            cfg.SEED_VALUE,
        )
        if not positions:  # nothing to hold out: no lr chosen, no feature picked by a score
            note += " every feature, and the first of BENCHMARK.FEATURES is reported as picked"
            grid = []
        notes.append(note)
        splits = [tuple(label_fraction.in_data_set(part, subset) for part in pair) for pair in positions]
    fit_loaders = [_fit_loader(cfg, part, device, fit) for part, _ in splits]
    total = cfg.OPTIMIZER.num_epochs * (len(train_loader) + sum(len(loader) for loader in fit_loaders))
    return grid, (splits, fit_loaders), total, notes


def _fit_loader(cfg, part: List[int], device, fit: label_fraction.BatchFit):
    batch = fit.batch("the fit parts", len(part))
    loader = label_fraction.fitted_train_loader(cfg, device, part, batch)
    if len(loader) == 0:
        raise ConfigError(
            "the fit part of DATA.TRAIN yields no full batch: lower LINEAR_HOLDOUT_FRACTION or LINEAR_LR_FOLDS"
        )
    return loader


def select_learning_rates(cfg, sources, dims, num_classes: int, grid: List[float], splits, progress):
    """Train one head per (feature, lr in ``grid``) on the fit part of DATA.TRAIN, score them on the
    held-out part (read with DATA.TEST's transform), keep each feature's best lr. With
    ``BENCHMARK.LINEAR_LR_FOLDS`` = k > 1, k such rounds over the stratified folds of TRAIN, every
    lr scored by its hits over all k held-out parts. ``sources``: (features of TRAIN batches,
    possibly cached; the trunk itself, for the held-out images); ``splits``: ([(fit, held-out)
    indices], the fit loaders); ``progress``: (the meter, the job's clock). One line per round.

    Returns ({feature: lr}, {feature: held-out top-1 % at that lr}, iterations done).
    """
    source, (meter, clock) = sources[1], progress
    (index_splits, fit_loaders), folds = splits, len(splits[0])
    inputs = {lr_grid.grid_key(f, i): f for f in source.names for i in range(len(grid))}
    lrs = {lr_grid.grid_key(f, i): lr for f in source.names for i, lr in enumerate(grid)}
    grid_heads = (dims, num_classes, inputs, lrs)
    per_fold, iterations = [], 0
    for fold, ((_, holdout), fit_loader) in enumerate(zip(index_splits, fit_loaders), start=1):
        results, iterations = _fit_and_score(
            cfg, sources, grid_heads, (fit_loader, holdout), meter, iterations
        )
        per_fold.append(results)
        logger.info(linear_report.fold_line(fold, folds, results, source.names, grid, clock, iterations))
    scores = lr_grid.pooled_top1(per_fold)
    chosen = lr_grid.choose_learning_rates(scores, source.names, grid)
    best = {f: scores[lr_grid.grid_key(f, grid.index(lr))] for f, lr in chosen.items()}
    held_out = sum(len(holdout) for _, holdout in index_splits)
    logger.info(
        f"lr grid on {held_out} held-out training images ({len(index_splits[0][0])} fit"
        + (f", {folds}-fold cross-validation" if folds > 1 else "")
        + "): "
        + ", ".join(f"{f} lr {chosen[f]:g} ({best[f]:.2f}%)" for f in source.names)
    )
    return chosen, best, iterations


def _fit_and_score(cfg, sources, grid_heads, split, meter: TrainingMeter, iterations: int):
    """One round of the lr grid: heads ``LinearHeads(*grid_heads)`` trained on ``split``'s fit
    loader, scored on its held-out indices. Returns ({head key: result}, iterations so far)."""
    train_source, source = sources
    fit_loader, holdout = split
    holdout_loader = build_loader(
        common.holdout_data_config(cfg.DATA),
        "TRAIN",
        seed=cfg.SEED_VALUE,
        device=source.device,
        indices=holdout,
    )
    heads_cfg = common.heads_model_config(cfg.MODEL)
    heads = parallelize(LinearHeads(*grid_heads), heads_cfg, source.device, shard=False)
    iterations = train_heads(train_source, heads, fit_loader, cfg.OPTIMIZER, meter, iterations)
    return evaluate(source, heads, holdout_loader), iterations
