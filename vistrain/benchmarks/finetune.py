"""Fine-tuning: the trunk and a linear head trained end to end with the labels (``JOB: finetune``).

MAE's end-to-end protocol (He et al. 2022; also solo-learn's and VISSL's): the pretrained trunk of
``MODEL.WEIGHTS_INIT`` (the student, or with ``BENCHMARK.WEIGHTS_FROM: teacher`` the momentum
teacher; no PARAMS_FILE: a random trunk, the supervised-from-scratch control) and a new linear head
on ``BENCHMARK.FINETUNE.FEATURE`` (:mod:`.finetune_model`) train on DATA.TRAIN's augmented images
(one view each: random resized crop, flips...) with cross-entropy (``LABEL_SMOOTHING``), the
``OPTIMIZER`` (SGD or AdamW; ``layer_decay`` for layer-wise lr decay, a ViT's ``DROP_PATH_RATE``),
its warm-up and cosine schedule. The model is sharded by our engine (``AUTO_SETUP_FSDP``) or
wrapped in DDP: the same numbers either way. With ``DATA.TRAIN.LABEL_FRACTION`` only that
stratified part of TRAIN is used (:mod:`.label_fraction`).

Choosing lr and epochs without the test images (``BENCHMARK.FINETUNE.LRS``): k-fold training runs
per candidate lr would cost k x the grid, so the selection is one held-out fold. A stratified
``HOLDOUT_FRACTION`` of the training images is held out; for every lr of ``LRS`` one run trains on
the rest for ``num_epochs`` and scores the held-out images after every epoch (read with DATA.TEST's
transform and ``BENCHMARK.FEATURE_VIEWS``); the best (lr, epoch) pair wins (ties: the smaller lr,
the earlier epoch). Each finished lr's scores go to ``CHECKPOINT.DIR/finetune_selection.json``
with the resolved config: a rerun of the same job in the same folder (after a stop) reads them
instead of training those runs again. The final run trains on all the training images with that
lr and the schedule of ``num_epochs``, stopped after that epoch: the trajectory the held-out
images scored.
Cost: ``len(LRS) * (1 - HOLDOUT_FRACTION) + 1`` runs. Without LRS: one run of ``OPTIMIZER``.

The test images are scored once, at the end, their logits averaged over ``FEATURE_VIEWS`` (ELPV:
the 8 symmetries), each image counted once on any world size. Outputs as linear evaluation's:
the log, ``metrics.json`` (its form; ``selection`` holds every held-out score), ``confusion.png``,
TensorBoard (``finetune/<feature>/top1``, the loss), and the fine-tuned model as a weights-only
checkpoint in CHECKPOINT.DIR (world-size independent; any job reads it as PARAMS_FILE).
"""

import dataclasses
import json
import os
import time
from typing import List, Optional, Tuple

import torch
import torch.nn.functional as F

from vistrain.benchmarks import common, eval_pictures, label_fraction, linear_heads, linear_report, lr_grid
from vistrain.benchmarks.finetune_model import build_run_model, check_feature_trains_the_trunk, view_logits
from vistrain.checkpoint import save_sharded_checkpoint
from vistrain.config import ConfigError
from vistrain.config.words import plural
from vistrain.data import build_loader, set_epoch
from vistrain.distributed import comm
from vistrain.fsdp import Backend, backend_of, unwrap
from vistrain.optim import build_lr_schedule, build_optimizer, set_lr
from vistrain.runtime import precision
from vistrain.runtime.logger import TrainingMeter, logger, timed
from vistrain.runtime.parallel import parallelize
from vistrain.runtime.run_setup import record_config, start_run
from vistrain.runtime.tracking import wandb_settings


@dataclasses.dataclass
class _Job:
    """What every training run of a fine-tuning job shares."""

    cfg: object
    device: torch.device
    num_classes: int
    train_loader: object  # the labelled images trained on (a label fraction's, or all of TRAIN)
    test_loader: object
    holdout: Optional[Tuple[object, object]]  # (fit loader, held-out loader) with FINETUNE.LRS
    notes: List[str] = dataclasses.field(default_factory=list)  # for the log: batches fitted, no choice
    meter: Optional[TrainingMeter] = None
    clock: Optional[linear_report.JobClock] = None
    iterations: int = 0  # over every run so far

    @property
    def groups(self) -> List[List[int]]:
        return [list(g) for g in self.cfg.BENCHMARK.CLASS_GROUPS]


def finetune(cfg) -> None:
    """Fine-tune the trunk of ``cfg.MODEL`` with a linear head on DATA.TRAIN; score it on DATA.TEST."""
    start = time.perf_counter()
    device = start_run(cfg)
    check_feature_trains_the_trunk(cfg)
    job = _build(cfg, device)
    record_config(cfg)  # built and checked: the job really starts
    lrs = [float(lr) for lr in cfg.BENCHMARK.FINETUNE.LRS] if job.holdout else []
    epochs = cfg.OPTIMIZER.num_epochs
    total = epochs * (len(job.train_loader) + len(lrs) * (len(job.holdout[0]) if job.holdout else 0))
    job.meter = TrainingMeter(
        cfg.CHECKPOINT.DIR, cfg.LOG_FREQUENCY, total, device, tracking=wandb_settings(cfg)
    )
    job.clock = linear_report.JobClock(total)
    _log_header(job, lrs)
    for note in job.notes:
        logger.info(note)
    lr, until, selection = _select(job, lrs) if lrs else (_base_lr(cfg), epochs, None)
    model, _ = train_run(job, lr, job.train_loader, until)
    logger.info(f"final fit on DATA.TRAIN done: lr {lr:g}, {plural(until, 'epoch')} ({job.clock.elapsed()})")
    train_seconds = time.perf_counter() - start
    result, outputs = evaluate(model, job.test_loader, job)
    result["dim"] = unwrap(model).head.in_features
    _report(job, result, (lr, until, selection), (start, train_seconds))
    _write_outputs(job, model, outputs)
    job.meter.summary()


def _build(cfg, device: torch.device) -> _Job:
    """The loaders (TRAIN: a label fraction's images; with FINETUNE.LRS its fit and held-out
    parts), each training pass's batch fitted to its images (``label_fraction.BatchFit``)."""
    fit = label_fraction.job_batch_fit(cfg)
    train_loader, subset = label_fraction.labelled_train_loader(cfg, device, fit=fit)
    test_loader = build_loader(cfg.DATA, "TEST", seed=cfg.SEED_VALUE, device=device)
    num_classes = common.num_classes(train_loader.dataset, test_loader.dataset)
    _check_batches(train_loader, "DATA.TRAIN")
    holdout, notes = None, []
    if cfg.BENCHMARK.FINETUNE.LRS:
        fraction, seed = cfg.BENCHMARK.FINETUNE.HOLDOUT_FRACTION, cfg.SEED_VALUE
        positions, note = lr_grid.lr_splits(train_loader.dataset.targets, 1, fraction, seed)
        if positions:
            holdout = _holdout_loaders(
                cfg, device, [label_fraction.in_data_set(p, subset) for p in positions[0]], fit
            )
        else:  # no class has two labelled images: nothing to hold out
            notes.append(f"{note} for OPTIMIZER's num_epochs, with no choice among BENCHMARK.FINETUNE.LRS")
    note = fit.note()
    return _Job(
        cfg, device, num_classes, train_loader, test_loader, holdout, notes + ([note] if note else [])
    )


def _holdout_loaders(cfg, device: torch.device, parts, fit: label_fraction.BatchFit):
    """(the fit part's loader, its batch fitted by ``fit``; the held-out part's, read like TEST) of
    ``parts`` = (fit, held-out) data set indices."""
    fit_part, held_out = parts
    batch = fit.batch("the fit part", len(fit_part))
    fit_loader = label_fraction.fitted_train_loader(cfg, device, fit_part, batch)
    _check_batches(fit_loader, "the fit part of DATA.TRAIN (lower FINETUNE.HOLDOUT_FRACTION)")
    held_out_data = common.holdout_data_config(cfg.DATA)
    seed = cfg.SEED_VALUE
    return fit_loader, build_loader(held_out_data, "TRAIN", seed=seed, device=device, indices=held_out)


def _check_batches(loader, what: str) -> None:
    if len(loader) == 0:
        raise ConfigError(
            f"{what} yields no full batch per rank: lower DATA.TRAIN.BATCHSIZE_PER_REPLICA, set "
            "DATA.TRAIN.DROP_LAST=False or raise DATA.TRAIN.LABEL_FRACTION"
        )


def _log_header(job: _Job, lrs: List[float]) -> None:
    cfg = job.cfg
    weights = cfg.MODEL.WEIGHTS_INIT.PARAMS_FILE
    weights = f"the {cfg.BENCHMARK.WEIGHTS_FROM} of {weights}" if weights else "a random trunk"
    logger.info(
        f"fine-tuning {weights} with a linear head on "
        f"{cfg.BENCHMARK.FINETUNE.FEATURE}, {plural(job.num_classes, 'class', 'classes')}: "
        f"{plural(cfg.OPTIMIZER.num_epochs, 'epoch')} x {plural(len(job.train_loader), 'iteration')} "
        f"on {plural(comm.get_world_size(), 'rank')}"
    )
    if not cfg.MODEL.WEIGHTS_INIT.PARAMS_FILE and comm.is_main_process():
        logger.warning("MODEL.WEIGHTS_INIT.PARAMS_FILE is empty: fine-tuning a RANDOMLY INITIALISED trunk")
    if lrs:
        fraction = cfg.BENCHMARK.FINETUNE.HOLDOUT_FRACTION
        logger.info(
            f"choosing the lr among {', '.join(f'{lr:g}' for lr in lrs)} and the epochs on a held-out "
            f"{fraction:.0%} of the training images (one run per lr on the rest, then the final fit)"
        )


def _base_lr(cfg) -> float:
    return float(cfg.OPTIMIZER.param_schedulers.lr.base_value)


# --------------------------------------------------------------------------------------------
# choosing lr and epochs on held-out training images


def _select(job: _Job, lrs: List[float]) -> Tuple[float, int, dict]:
    """One run per lr on the fit part, scored on the held-out part after every epoch. Returns
    (lr, epochs, the record: every held-out top-1 by lr and epoch, the best)."""
    fit_loader, held_out = job.holdout
    epochs, earlier, scores = job.cfg.OPTIMIZER.num_epochs, _earlier_scores(job.cfg), {}
    for lr in lrs:
        if lr in earlier:
            scores[lr] = earlier[lr]
            job.iterations += epochs * len(fit_loader)  # counted as run: the ETA stays true
            logger.info(f"lr {lr:g}: the held-out scores of an earlier run of this job ({SELECTION_FILE})")
            continue
        _, scores[lr] = train_run(job, lr, fit_loader, epochs, held_out)
        _save_scores(job.cfg, scores)
        best = max(scores[lr])
        logger.info(
            f"lr {lr:g} done ({job.clock.elapsed()}): best held-out top-1 {best:.2f}% after "
            f"{plural(scores[lr].index(best) + 1, 'epoch')}; eta {job.clock.eta(job.iterations)}"
        )
    lr, epochs = best_run(scores)
    top1 = scores[lr][epochs - 1]
    logger.info(
        f"held-out choice on {plural(len(held_out.dataset), 'training image')} "
        f"({len(fit_loader.dataset)} fit): lr {lr:g}, {plural(epochs, 'epoch')} ({top1:.2f}%)"
    )
    edge = grid_edge(lr, lrs)
    if edge:
        logger.info(
            f"note: lr {lr:g} is the {edge} of BENCHMARK.FINETUNE.LRS: a grid past it may choose better"
        )
    selection = {
        "lrs": lrs,
        "holdout_images": len(held_out.dataset),
        "holdout_top1": {f"{lr:g}": s for lr, s in scores.items()},
        "best": {"lr": lr, "epochs": epochs, "holdout_top1": top1},
    }
    return lr, epochs, selection


SELECTION_FILE = "finetune_selection.json"


def _earlier_scores(cfg) -> dict:
    """Collective: {lr: held-out top-1 per epoch} of the selection runs that an earlier run of
    the same job (the same resolved config) in CHECKPOINT.DIR finished; {} when none."""
    scores = {}
    path = os.path.join(cfg.CHECKPOINT.DIR, SELECTION_FILE)
    if comm.is_main_process() and os.path.isfile(path):
        try:
            with open(path) as f:
                saved = json.load(f)
            if saved.get("config") == cfg.dump():
                scores = {float(lr): list(s) for lr, s in saved["holdout_top1"].items()}
        except (ValueError, KeyError, TypeError, AttributeError):  # not ours to read: run every lr again
            logger.warning(f"{path} is unreadable: every lr of BENCHMARK.FINETUNE.LRS runs again")
    return comm.all_gather_object(scores)[0]


def _save_scores(cfg, scores: dict) -> None:
    """Rank 0: the finished selection runs' scores, with the config they belong to."""
    record = {"config": cfg.dump(), "holdout_top1": {repr(lr): s for lr, s in scores.items()}}
    common.write_metrics(cfg.CHECKPOINT.DIR, record, SELECTION_FILE)


def grid_edge(lr: float, lrs: List[float]) -> str:
    """Which end of a grid of several lrs the chosen ``lr`` is ("smallest", "largest"), else ""."""
    if len(set(lrs)) < 2:
        return ""
    return "smallest" if lr == min(lrs) else "largest" if lr == max(lrs) else ""


def best_run(scores: dict) -> Tuple[float, int]:
    """(lr, epochs) of the highest held-out top-1 in ``scores`` ({lr: [top-1 after epoch 1, 2...]});
    ties go to the smaller lr, then to fewer epochs."""
    _, lr, epochs = max((top1, -lr, -epoch) for lr, s in scores.items() for epoch, top1 in enumerate(s, 1))
    return -lr, -epochs


# --------------------------------------------------------------------------------------------
# a training run


@dataclasses.dataclass
class _Step:
    """What every step of a run needs besides model and optimizer."""

    device: torch.device
    amp_dtype: Optional[torch.dtype]
    scaling: Optional[precision.LossScaling]  # float16 only
    clip_grad_norm: float
    label_smoothing: float
    memory_format: torch.memory_format


def train_run(job: _Job, lr: float, loader, epochs: int, held_out=None):
    """Collective: a fresh model (the pretrained trunk, a new head) trained ``epochs`` epochs of the
    schedule of ``num_epochs`` at peak lr ``lr`` on ``loader``; with ``held_out`` (a loader) scored
    on it after every epoch. Returns (the wrapped model, [held-out top-1 % per epoch])."""
    cfg = job.cfg
    model = parallelize(build_run_model(cfg, job.num_classes), cfg.MODEL, job.device)
    opt_cfg = cfg.OPTIMIZER.clone()
    opt_cfg.defrost()
    if _base_lr(cfg) > 0:  # a candidate lr scales the whole schedule (end_value too)
        opt_cfg.param_schedulers.lr.end_value *= lr / _base_lr(cfg)
    opt_cfg.param_schedulers.lr.base_value = lr
    optimizer = build_optimizer(opt_cfg, model, unwrap(model).lr_layer)
    schedule = build_lr_schedule(opt_cfg, len(loader))
    step = _step_settings(cfg, model, job.device)
    scores = []
    for epoch in range(epochs):
        set_epoch(loader, epoch)
        model.train()
        for i, (batch, waited) in enumerate(timed(loader)):
            set_lr(optimizer, schedule(epoch * len(loader) + i))
            loss = _train_step(model, optimizer, batch, step)
            job.meter.update(loss, batch["index"].shape[0], data_time=waited)
            job.iterations += 1
            if job.meter.should_log(job.iterations):
                job.meter.log(job.iterations, epoch, epochs, schedule(epoch * len(loader) + i))
        if held_out is not None:
            scores.append(evaluate(model, held_out, job)[0]["top1"])
    return model, scores


def _step_settings(cfg, model, device: torch.device) -> _Step:
    memory_format = torch.channels_last if cfg.MODEL.CHANNELS_LAST else torch.contiguous_format
    return _Step(
        device,
        precision.amp_dtype(cfg.MODEL),
        precision.loss_scaling(model, cfg.MODEL, device),
        float(cfg.OPTIMIZER.clip_grad_norm),
        float(cfg.BENCHMARK.FINETUNE.LABEL_SMOOTHING),
        memory_format,
    )


def _train_step(model, optimizer, batch: dict, s: _Step) -> torch.Tensor:
    """Forward under autocast, cross-entropy (label smoothing), backward, [clip], step. Returns
    this rank's loss (detached)."""
    images = batch["crops"][0].to(s.device, non_blocking=True).contiguous(memory_format=s.memory_format)
    labels = batch["label"].to(s.device, non_blocking=True)
    with torch.autocast(s.device.type, dtype=s.amp_dtype or torch.float32, enabled=s.amp_dtype is not None):
        logits = model(images)
    loss = F.cross_entropy(logits.float(), labels, label_smoothing=s.label_smoothing)
    optimizer.zero_grad(set_to_none=True)
    (s.scaling.scaler.scale(loss) if s.scaling is not None else loss).backward()
    if s.clip_grad_norm > 0:
        if s.scaling is not None:
            s.scaling.scaler.unscale_(optimizer)
        if backend_of(model) is not Backend.REPLICATED:  # sharded: the norm spans all shards
            model.clip_grad_norm_(s.clip_grad_norm)
        else:
            torch.nn.utils.clip_grad_norm_(model.parameters(), s.clip_grad_norm)
    if s.scaling is not None:
        s.scaling.step(optimizer)
    else:
        optimizer.step()
    return loss.detach()


# --------------------------------------------------------------------------------------------
# scoring and reporting


@torch.no_grad()
def evaluate(model, loader, job: _Job):
    """Collective: top-1/top-5 [and the class groups'] of ``model`` over ``loader``'s images, each
    counted once, logits averaged over BENCHMARK.FEATURE_VIEWS. Returns (the result {"top1": %...,
    "num_images"}, (labels (N,), predicted classes (N,)) of every image sorted by index)."""
    model.eval()
    set_epoch(loader, 0)
    views, dtype = job.cfg.BENCHMARK.FEATURE_VIEWS, precision.amp_dtype(job.cfg.MODEL)
    hits, labels, predicted, indices = [], [], [], []
    for batch in loader:
        images, batch_labels = batch["crops"][0].to(job.device), batch["label"].to(job.device)
        logits = view_logits(model, images, views, dtype)
        hits.append(linear_heads.class_hits(logits, batch_labels, job.groups)[:, None])  # (B, 1, M)
        labels.append(batch_labels)
        predicted.append(logits.argmax(dim=1))
        indices.append(batch["index"].to(job.device))
    indices = torch.cat(indices)
    metrics = linear_heads.metric_names(job.groups)
    [result] = linear_heads.summed_hits(torch.cat(hits), indices, ["model"], metrics).values()
    _, (labels, predicted) = common.gather_unique(indices, torch.cat(labels), torch.cat(predicted))
    return result, (labels, predicted)


def _report(job: _Job, result: dict, choice, times) -> None:
    """Log table, TensorBoard and metrics.json, in linear evaluation's form: the one fine-tuned
    feature under "results" (and "picked"), with its lr and epochs and, after a selection, its
    held-out top-1; ``choice``: (lr, epochs, selection record or None)."""
    cfg = job.cfg
    lr, epochs, selection = choice
    feature = cfg.BENCHMARK.FINETUNE.FEATURE
    if selection is not None:
        result.update(lr=lr, holdout_top1=selection["best"]["holdout_top1"])
    extra = {"num_classes": job.num_classes, "iterations": job.iterations, "epochs": epochs, "lr": lr}
    record = linear_report.record(cfg, "finetune", {feature: result}, extra, times)
    record.update(label_fraction.record(cfg, len(job.train_loader.dataset)), selection=selection)
    linear_report.report(cfg.CHECKPOINT.DIR, record, job.meter.writer, "fine-tuning")


def _write_outputs(job: _Job, model, outputs) -> None:
    """Collective: confusion.png of the test images (rank 0) and the fine-tuned model, a
    weights-only checkpoint in CHECKPOINT.DIR."""
    cfg = job.cfg
    info = {"feature": cfg.BENCHMARK.FINETUNE.FEATURE, "num_classes": job.num_classes, "step": job.iterations}
    info["class_names"] = eval_pictures.class_names(job.test_loader.dataset)
    if comm.is_main_process():
        path = eval_pictures.write_confusion(cfg.CHECKPOINT.DIR, job.meter.writer, outputs, info, "finetune")
        logger.info(f"wrote {path}")
    meta = {"config": cfg.dump(), "engine": "finetune"}
    path = save_sharded_checkpoint(cfg.CHECKPOINT.DIR, job.iterations, model, None, {}, meta, keep_last=1)
    logger.info(f"saved the fine-tuned model: {path}")
