"""Linear evaluation of a frozen trunk, one rank: ``linear_eval(cfg)`` (``JOB: linear_eval``).

The standard protocol (Goyal et al., "Scaling and Benchmarking Self-Supervised Visual
Representation Learning", 2019, as in VISSL): the pretrained trunk is frozen and, for every
feature in ``BENCHMARK.FEATURES``, a linear classifier ``Linear(BatchNorm1d(f, affine=False))``
is trained on the pooled feature ``f`` with SGD (+ nesterov) and a step or cosine schedule. All
heads train together from one pass of the trunk per batch, so evaluating several stages costs one
trunk forward. With ``BENCHMARK.LINEAR_LRS`` each feature's learning rate is chosen on held-out
TRAIN images first, one holdout or k folds (see :mod:`vistrain.benchmarks.lr_grid`); with the
deterministic ``eval`` TRAIN transform the frozen features are computed once
(:class:`CachedFeatures`). Top-1/top-5 on ``DATA.TEST`` are written to the log, TensorBoard
(``linear_eval/<feature>/top1``) and ``CHECKPOINT.DIR/metrics.json``; the trained heads to
``CHECKPOINT.DIR/linear_heads.pt``.

Distributed: the heads are data parallel (DDP, sync BatchNorm when configured); the trunk is
either replicated or sharded by our engine (``AUTO_SETUP_FSDP``). Test counts are de-duplicated
(the sampler pads with repeats) and summed over ranks, so they are exact for any world size.
"""

import dataclasses
import os
import time
from typing import Dict, List, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from vistrain.benchmarks import common, eval_pictures, linear_report, lr_grid
from vistrain.config import ConfigError
from vistrain.config.words import plural
from vistrain.data import build_loader, set_epoch
from vistrain.distributed import comm
from vistrain.fsdp import unwrap
from vistrain.optim import build_lr_schedule, build_optimizer, set_lr
from vistrain.runtime.logger import TrainingMeter, logger
from vistrain.runtime.parallel import parallelize
from vistrain.runtime.precision import amp_dtype
from vistrain.runtime.run_setup import record_config, start_run


class LinearHeads(nn.Module):
    """One ``BatchNorm1d(D, affine=False) -> Linear(D, num_classes)`` per head.

    ``forward({feature: (N, D_feature) float32})`` -> ``{head key: logits (N, num_classes)}``. By
    default there is one head per feature, keyed by the feature's name; ``inputs`` ({head key:
    feature}) allows several heads per feature (a learning-rate grid) and ``lrs`` ({head key:
    peak lr}) gives heads their own learning rate (absent: ``OPTIMIZER``'s schedule). The
    parameter-free BatchNorm standardises features whose scales differ wildly between stages, so
    one learning rate suits every head (VISSL's "eval_mlp").
    """

    def __init__(
        self,
        dims: Dict[str, int],
        num_classes: int,
        inputs: Optional[Dict[str, str]] = None,
        lrs: Optional[Dict[str, float]] = None,
    ):
        super().__init__()
        self.inputs = dict(inputs) if inputs is not None else {name: name for name in dims}
        self.lrs = dict(lrs or {})
        self.heads = nn.ModuleDict()
        for key, feature in self.inputs.items():
            linear = nn.Linear(dims[feature], num_classes)
            nn.init.normal_(linear.weight, std=0.01)
            nn.init.zeros_(linear.bias)
            self.heads[key] = nn.Sequential(nn.BatchNorm1d(dims[feature], affine=False), linear)

    def forward(self, features: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
        return {key: head(features[self.inputs[key]]) for key, head in self.heads.items()}


@dataclasses.dataclass
class FrozenFeatures:
    """Batch -> (pooled trunk features {name: (B, D) float32}, labels (B,)) on ``device``."""

    trunk: nn.Module
    names: List[str]
    pool_size: int
    dtype: Optional[torch.dtype]  # autocast of the trunk forward; None: fp32
    device: torch.device
    views: str = "identity"  # BENCHMARK.FEATURE_VIEWS

    def __call__(self, batch: dict):
        images, labels = batch["crops"][0].to(self.device), batch["label"].to(self.device)
        features = common.trunk_features(
            self.trunk, images, self.names, self.pool_size, self.dtype, self.views
        )
        return features, labels


@dataclasses.dataclass
class CachedFeatures:
    """Batch -> (features looked up by sample index in a bank, labels (B,)) on ``device``.

    For a deterministic TRAIN transform (``NAME: eval``) the frozen trunk gives every image the same
    features in every epoch, so they are computed once (:func:`cache_features`) instead of once per
    epoch and per learning-rate pass. ``bank[name]`` is (N, D) float32; ``rows[i]`` is the bank row
    of data set index i.
    """

    names: List[str]
    bank: Dict[str, torch.Tensor]
    rows: torch.Tensor
    device: torch.device

    def __call__(self, batch: dict):
        rows = self.rows[batch["index"].to(self.device)]
        return {name: self.bank[name][rows] for name in self.names}, batch["label"].to(self.device)

    @staticmethod
    def batches(loader):
        """The batches ``loader`` would yield, as {"index", "label"} only: the same samples in the
        same order (its sampler's), without reading or transforming a single image."""
        dataset = loader.dataset
        parent = torch.as_tensor(dataset.indices) if hasattr(dataset, "indices") else None  # IndexSubset
        labels = torch.as_tensor(dataset.targets)
        keys = torch.tensor([index for index, _ in loader.sampler], dtype=torch.long)
        for start in range(0, len(keys), loader.batch_size):
            chunk = keys[start : start + loader.batch_size]
            if loader.drop_last and len(chunk) < loader.batch_size:
                return
            yield {"index": chunk if parent is None else parent[chunk], "label": labels[chunk]}


def cache_features(source: FrozenFeatures, data_cfg, seed: int) -> CachedFeatures:
    """Collective: one pass of the trunk over all of DATA.TRAIN (in order, nothing dropped), every
    rank's features gathered so that each rank holds the whole bank."""
    loader = common.ordered_loader(data_cfg, "TRAIN", seed, source.device)
    feats, _, indices = common.extract(
        source.trunk, loader, source.names, source.pool_size, source.dtype, source.device, source.views
    )
    indices, banks = common.gather_unique(indices, *[feats[name] for name in source.names])
    rows = torch.full((int(indices.max()) + 1,), -1, dtype=torch.long, device=source.device)
    rows[indices] = torch.arange(indices.shape[0], device=source.device)
    return CachedFeatures(source.names, dict(zip(source.names, banks)), rows, source.device)


def linear_eval(cfg) -> None:
    """Train linear heads on the frozen trunk's features of DATA.TRAIN, evaluate on DATA.TEST."""
    start = time.perf_counter()
    run_dir = cfg.CHECKPOINT.DIR
    device = start_run(cfg)

    # ---- build
    train_loader = build_loader(cfg.DATA, "TRAIN", seed=cfg.SEED_VALUE, device=device)
    test_loader = build_loader(cfg.DATA, "TEST", seed=cfg.SEED_VALUE, device=device)
    num_classes = common.num_classes(train_loader.dataset, test_loader.dataset)
    if len(train_loader) == 0:
        raise ConfigError("DATA.TRAIN yields no full batch per rank: add data or lower BATCHSIZE_PER_REPLICA")
    trunk, dims = common.build_frozen_trunk(cfg, device)
    record_config(cfg)  # built and loaded: the job really starts
    source = FrozenFeatures(
        trunk, list(dims), cfg.BENCHMARK.POOL_SIZE, amp_dtype(cfg.MODEL), device, cfg.BENCHMARK.FEATURE_VIEWS
    )
    grid, (splits, fit_loaders), total = _passes(cfg, train_loader, device)
    epochs = cfg.OPTIMIZER.num_epochs
    logger.info(
        linear_report.header(
            source.names, dims, num_classes, epochs, len(train_loader), comm.get_world_size()
        )
    )
    if grid:
        logger.info(linear_report.grid_plan(grid, len(splits), cfg.BENCHMARK.LINEAR_HOLDOUT_FRACTION))
    train_source = source
    if cfg.DATA.TRAIN.TRANSFORMS.NAME == "eval" and not cfg.DATA.TRAIN.SKIP_CORRUPT:
        # the same features every epoch: compute them once (a skipped image would have no row)
        train_source = cache_features(source, cfg.DATA, cfg.SEED_VALUE)

    # ---- [choose each feature's lr on held-out training images], train, evaluate, report
    meter = TrainingMeter(run_dir, cfg.LOG_FREQUENCY, total, device, console=False)
    clock = linear_report.JobClock(total)
    lrs, selection, iterations = {}, None, 0
    if grid:
        lrs, selection, iterations = select_learning_rates(
            cfg, (train_source, source), dims, num_classes, grid, (splits, fit_loaders), (meter, clock)
        )
    heads = LinearHeads(dims, num_classes, lrs=lrs)
    heads = parallelize(heads, common.heads_model_config(cfg.MODEL), device, shard=False)
    iterations = train_heads(train_source, heads, train_loader, cfg.OPTIMIZER, meter, iterations)
    logger.info(f"final fit on DATA.TRAIN done ({clock.elapsed()})")
    train_seconds = time.perf_counter() - start
    groups = [list(g) for g in cfg.BENCHMARK.CLASS_GROUPS]
    results = linear_report.with_choices(evaluate(source, heads, test_loader, groups), dims, lrs, selection)
    picked = linear_report.picked_feature(results)
    record = {
        "engine": "linear_eval",
        "weights": cfg.MODEL.WEIGHTS_INIT.PARAMS_FILE,
        "num_classes": num_classes,
        "epochs": epochs,
        "iterations": iterations,
        "world_size": comm.get_world_size(),
        "results": results,
        "picked": {"feature": picked, **results[picked]},  # by cross-validation on TRAIN, not by TEST
        "train_seconds": train_seconds,
        "total_seconds": time.perf_counter() - start,
    }
    _report(run_dir, record, meter.writer)
    bank = (
        train_source
        if isinstance(train_source, CachedFeatures)
        else cache_features(source, cfg.DATA, cfg.SEED_VALUE)
    )
    loaders = (train_loader, test_loader)
    for path in eval_pictures.draw(
        cfg, source, heads, loaders, picked, bank, num_classes, meter.writer, iterations
    ):
        logger.info(f"wrote {path}")
    if comm.is_main_process():
        torch.save(unwrap(heads).state_dict(), os.path.join(run_dir, "linear_heads.pt"))
    meter.summary()


def _passes(cfg, train_loader, device):
    """(the lr grid, ([(fit, held-out) indices of DATA.TRAIN], their fit loaders), the iterations of
    the whole job: every grid round's and the final fit's, each ``num_epochs`` long)."""
    grid = [float(lr) for lr in cfg.BENCHMARK.LINEAR_LRS]
    splits = _lr_splits(cfg, train_loader.dataset.targets) if grid else []
    fit_loaders = [_fit_loader(cfg, fit, device) for fit, _ in splits]
    total = cfg.OPTIMIZER.num_epochs * (len(train_loader) + sum(len(loader) for loader in fit_loaders))
    return grid, (splits, fit_loaders), total


def _lr_splits(cfg, labels) -> List[Tuple[List[int], List[int]]]:
    """(fit, held-out) sample indices of DATA.TRAIN: k stratified folds, or one holdout."""
    folds = int(cfg.BENCHMARK.LINEAR_LR_FOLDS)
    if folds > 1:
        return lr_grid.stratified_folds(labels, folds, cfg.SEED_VALUE)
    return [lr_grid.holdout_split(labels, cfg.BENCHMARK.LINEAR_HOLDOUT_FRACTION, cfg.SEED_VALUE)]


def _fit_loader(cfg, fit: List[int], device):
    loader = build_loader(cfg.DATA, "TRAIN", seed=cfg.SEED_VALUE, device=device, indices=fit)
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
        _holdout_data_config(cfg.DATA), "TRAIN", seed=cfg.SEED_VALUE, device=source.device, indices=holdout
    )
    heads_cfg = common.heads_model_config(cfg.MODEL)
    heads = parallelize(LinearHeads(*grid_heads), heads_cfg, source.device, shard=False)
    iterations = train_heads(train_source, heads, fit_loader, cfg.OPTIMIZER, meter, iterations)
    return evaluate(source, heads, holdout_loader), iterations


def train_heads(
    source: FrozenFeatures, heads: nn.Module, loader, opt_cfg, meter: TrainingMeter, first_iteration: int = 0
) -> int:
    """``opt_cfg.num_epochs`` epochs of SGD on the heads (cross-entropy summed over heads).

    A head with its own lr follows the schedule scaled by lr / ``base_value``. Returns the
    iteration count (``first_iteration`` plus this pass's). The trunk only ever runs under
    ``no_grad`` in eval mode.
    """
    optimizers = _head_optimizers(opt_cfg, unwrap(heads))
    lr_schedule = build_lr_schedule(opt_cfg, len(loader))
    iteration = first_iteration
    for epoch in range(opt_cfg.num_epochs):
        set_epoch(loader, epoch)
        heads.train()
        batches = source.batches(loader) if isinstance(source, CachedFeatures) else loader
        for step, batch in enumerate(batches):
            lr = lr_schedule(epoch * len(loader) + step)
            for optimizer, scale in optimizers:
                set_lr(optimizer, lr * scale)
            features, labels = source(batch)
            logits = heads(features)
            # the heads are independent, so the sum's gradient is every head's own gradient
            loss = sum(F.cross_entropy(head_logits, labels) for head_logits in logits.values())
            for optimizer, _ in optimizers:
                optimizer.zero_grad(set_to_none=True)
            loss.backward()
            for optimizer, _ in optimizers:
                optimizer.step()
            meter.update(loss.detach() / len(logits), num_images=labels.shape[0])
            iteration += 1
            if meter.should_log(iteration):
                meter.log(iteration, epoch, opt_cfg.num_epochs, lr)
    return iteration


def _head_optimizers(opt_cfg, heads: LinearHeads) -> List[Tuple[torch.optim.Optimizer, float]]:
    """One (optimizer, lr scale) per distinct head lr; heads without one follow the schedule (scale 1)."""
    base = float(opt_cfg.param_schedulers.lr.base_value)
    by_scale: Dict[float, List[str]] = {}
    for key in heads.heads:
        lr = heads.lrs.get(key)
        if lr is not None and base <= 0:
            raise ValueError("per-head learning rates scale the schedule: lr.base_value must be > 0")
        by_scale.setdefault(1.0 if lr is None else lr / base, []).append(key)
    return [
        (build_optimizer(opt_cfg, nn.ModuleDict({k: heads.heads[k] for k in keys})), scale)
        for scale, keys in by_scale.items()
    ]


@torch.no_grad()
def evaluate(source: FrozenFeatures, heads: nn.Module, loader, groups=()) -> Dict[str, dict]:
    """Collective: top-1/top-5 of every head over ``loader``'s data set, each image counted once;
    with ``groups`` (BENCHMARK.CLASS_GROUPS) also ``top1_<len(groups)>class``.

    Returns ``{head key: {"top1": %, "top5": %, ["top1_2class": %,] "num_images": int}}``, equal on all ranks.
    """
    heads.eval()
    set_epoch(loader, 0)
    names = list(unwrap(heads).heads)
    metrics = ["top1", "top5"] + ([f"top1_{len(groups)}class"] if groups else [])
    hits = [torch.zeros(0, len(names), len(metrics), dtype=torch.bool, device=source.device)]
    indices = [torch.zeros(0, dtype=torch.long, device=source.device)]
    for batch in loader:
        features, labels = source(batch)
        logits = heads(features)
        hits.append(torch.stack([_hits(logits[n], labels, groups) for n in names], dim=1))  # (B, H, M)
        indices.append(batch["index"].to(source.device))
    hits, indices = torch.cat(hits), torch.cat(indices)
    keep = common.unique_on_this_rank(indices)
    counts = torch.zeros(len(names), len(metrics) + 1, dtype=torch.float64, device=source.device)
    counts[:, :-1] = hits[keep].sum(dim=0).to(torch.float64)
    counts[:, -1] = keep.sum()
    return common.summarise(comm.all_reduce_sum(counts), names, metrics)


def _hits(logits: torch.Tensor, labels: torch.Tensor, groups) -> torch.Tensor:
    """Bool (B, M): top-1, top-5 [and the group of classes] right."""
    hits = common.topk_correct(logits, labels)
    if groups:
        hits = torch.cat([hits, common.grouped_correct(logits, labels, groups)[:, None]], dim=1)
    return hits


def _report(run_dir: str, record: dict, writer) -> None:
    """Log table, TensorBoard scalars (rank 0's ``writer``) and metrics.json."""
    weights = record["weights"] or "random init"
    results = record["results"]
    title = f"linear evaluation on DATA.TEST ({weights}, {plural(next(iter(results.values()))['num_images'], 'image')}):"
    linear_report.log_lines(linear_report.results_table(title, results, "lr" in next(iter(results.values()))))
    picked = record["picked"]
    logger.info(
        f"picked by the held-out top-1 on TRAIN: {picked['feature']}, top-1 {picked['top1']:.2f}%"
        + "".join(f", {k} {v:.2f}%" for k, v in picked.items() if k.startswith("top1_"))
    )
    if writer is not None:
        for name, res in record["results"].items():
            for metric in [k for k in res if k.startswith("top")]:
                writer.add_scalar(f"linear_eval/{name}/{metric}", res[metric], record["iterations"])
        writer.flush()
    logger.info(f"wrote {common.write_metrics(run_dir, record)}")


# --------------------------------------------------------------------------------------------
# checks and config


def _holdout_data_config(data_cfg):
    """DATA with TRAIN read like TEST (its transform and batch size, in order, nothing dropped)."""
    holdout = data_cfg.clone()
    holdout.defrost()
    holdout.TRAIN.TRANSFORMS = data_cfg.TEST.TRANSFORMS.clone()
    holdout.TRAIN.BATCHSIZE_PER_REPLICA = data_cfg.TEST.BATCHSIZE_PER_REPLICA
    holdout.TRAIN.SHUFFLE = holdout.TRAIN.DROP_LAST = False
    holdout.freeze()
    return holdout
