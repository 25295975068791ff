"""Self-supervised pre-training, one rank: ``train(cfg)``.

The loop reads top to bottom: build (data, model, loss, optimizer, schedule), resume, then for
every batch: forward under autocast -> loss -> backward (accumulating over ``update_freq``
micro-batches without gradient sync) -> clip -> step -> log -> checkpoint. Method state (SwAV
queue, prototype freezing and normalisation, DINO's centre) lives on the criterion
(``vistrain/methods/``) and is called explicitly; the criterion says which crops go to the student
and which to the momentum teacher, when the method has one (DINO, BYOL), whose EMA follows every
optimizer step. Nothing here names a method.
With ``OPTIMIZER.step_in_backward`` the sharded engine runs the step inside the last micro-batch's
backward, shard by shard (``vistrain.fsdp.grads``); the loop then only tells it which
parameters are frozen this step.

Iterations are counted per data batch; ``iteration`` in logs, metrics and checkpoint names is the
number of completed iterations.
"""

import contextlib
import dataclasses
import functools
from typing import Optional, Sequence, Tuple

import torch
from torch import nn

from vistrain.checkpoint import (
    EpochLayout,
    find_latest_checkpoint,
    load_pretrained,
    save_sharded_checkpoint,
)
from vistrain.config import ConfigError, InputError
from vistrain.config.words import plural
from vistrain.data import build_loader, set_epoch
from vistrain.distributed import comm
from vistrain.distributed.launch import resolve_device
from vistrain.fsdp import (
    Backend,
    OptimizerInBackward,
    PartialStepError,
    apply_optimizer_in_backward,
    backend_of,
)
from vistrain.losses import MomentumTeacher
from vistrain.methods import build_method, build_model
from vistrain.optim import ParamSchedules, build_optimizer, build_schedules, clip_gradients, lr_scaling_note
from vistrain.planner.across_nodes import choose_across_nodes
from vistrain.planner.auto_tune import check_same_knobs, exact_knobs_of
from vistrain.runtime import precision
from vistrain.runtime.logger import (
    LOG_FILE_ONLY,
    NonFiniteLossError,
    TrainingMeter,
    divergence_message,
    logger,
    timed,
)
from vistrain.runtime.parallel import parallelize
from vistrain.runtime.pictures import save_picture, view_sheet
from vistrain.runtime.run_setup import record_config, start_run
from vistrain.runtime.sharding import build_for_run
from vistrain.runtime.teacher import build_teacher
from vistrain.runtime.tracking import wandb_settings
from vistrain.training.monitor import Monitor
from vistrain.training.online_probe import OnlineProbe, build_online_probe
from vistrain.training.preemption import BoundaryStop
from vistrain.training.resume import resume


@dataclasses.dataclass
class StepSettings:
    """What every optimizer step needs besides model, loss and optimizer."""

    device: torch.device
    amp_dtype: Optional[torch.dtype]  # None: no autocast
    scaling: Optional[precision.LossScaling]  # float16 only
    update_freq: int
    clip_grad_norm: float
    in_backward: Optional[OptimizerInBackward]  # the step runs inside backward (sharded engine)
    memory_format: torch.memory_format = torch.contiguous_format  # of the image batches (N, C, H, W)
    clip_per_parameter: bool = False  # each parameter's norm clipped on its own (DINO), not the global


@dataclasses.dataclass
class _Run:
    """What a training run builds before its loop."""

    loader: object
    model: nn.Module
    criterion: nn.Module
    optimizer: torch.optim.Optimizer
    schedules: ParamSchedules
    settings: StepSettings
    layout: EpochLayout
    num_epochs: int
    teacher: Optional[MomentumTeacher] = None  # the method's momentum teacher, if it has one
    probe: Optional[OnlineProbe] = None  # MONITOR.ONLINE_PROBE's linear head, outside the model

    @property
    def total_iterations(self) -> int:
        return self.num_epochs * self.layout.iters_per_epoch

    def watched(self, network: str) -> nn.Module:
        """The network the kNN job would evaluate (BENCHMARK.WEIGHTS_FROM): the student, or the
        teacher where the run has one."""
        return self.teacher.model if network == "teacher" and self.teacher is not None else self.model

    def checkpointed_models(self):
        """What a checkpoint holds: the student, and the teacher under ``teacher.``."""
        if self.teacher is None:
            return self.model
        return {"": self.model, "teacher.": self.teacher.model}


def train(cfg, notes: Sequence[str] = (), across_nodes=None) -> None:
    """Pre-train ``cfg.MODEL`` with ``cfg.LOSS`` on ``cfg.DATA.TRAIN``; call on every rank (see
    launch). ``notes``: lines rank 0 writes first to log.txt (what the auto-tuner chose, in
    detail); ``across_nodes``: the auto-tuner's ``(candidates, layout)`` for the ranks of a
    multi-node job to choose from (``vistrain.planner.across_nodes``), before anything is seeded or
    built."""
    choice_across_nodes = None
    if across_nodes:
        cfg, choice_across_nodes = choose_across_nodes(cfg, *across_nodes, _this_device(cfg))
    device = start_run(cfg)
    for note in notes:
        logger.info(note, extra=LOG_FILE_ONLY)  # the console had the launcher's short line
    if choice_across_nodes:
        logger.info(choice_across_nodes)
    if cfg.MODEL.FSDP_CONFIG.AUTO_TUNE:  # nodes that planned for different budgets would disagree
        check_same_knobs(comm.all_gather_object(exact_knobs_of(cfg)))
    run = _build(cfg, device)
    iteration, resumed_from = 0, 0
    if cfg.CHECKPOINT.AUTO_RESUME:
        iteration, resumed_from = resume(cfg.CHECKPOINT.DIR, run, cfg)
    iters_per_epoch = run.layout.iters_per_epoch
    if iteration >= run.total_iterations:
        logger.info(
            f"nothing to do: {cfg.CHECKPOINT.DIR} already holds {plural(iteration / iters_per_epoch, 'epoch')} "
            f"of the {run.num_epochs} asked for (to train on: raise OPTIMIZER.num_epochs, with "
            "config.CHECKPOINT.ALLOW_OTHER_SCHEDULE=True)"
        )
        return
    record_config(cfg, trained_until=resumed_from)
    logger.info(
        f"training {plural(run.num_epochs, 'epoch')} x {plural(iters_per_epoch, 'iteration')} on "
        f"{plural(comm.get_world_size(), 'rank')} ({device.type}), from iteration {iteration}"
    )
    _train_epochs(cfg, run, iteration)


def _build(cfg, device: torch.device) -> _Run:
    """Data, model (sharded or DDP), loss, optimizer, schedule and step settings of ``cfg``."""
    loader = build_loader(cfg.DATA, "TRAIN", seed=cfg.SEED_VALUE, device=device)
    iters_per_epoch = len(loader)
    if iters_per_epoch == 0:
        raise ConfigError("DATA.TRAIN yields no full batch per rank: add data or lower BATCHSIZE_PER_REPLICA")
    model = build_for_run(build_model, cfg.MODEL)  # on the meta device for the sharded engine
    if cfg.MODEL.WEIGHTS_INIT.PARAMS_FILE:
        load_pretrained(model, cfg.MODEL.WEIGHTS_INIT)  # before sharding (deferred when on meta)
    model = parallelize(model, cfg.MODEL, device)  # param groups follow the original parameters
    optimizer = build_optimizer(cfg.OPTIMIZER, model)
    settings = _step_settings(cfg, model, optimizer, device)
    global_batch = cfg.DATA.TRAIN.BATCHSIZE_PER_REPLICA * comm.get_world_size()
    layout = EpochLayout(iters_per_epoch, global_batch, len(loader.dataset), settings.update_freq)
    criterion = build_method(cfg).to(device)
    teacher = None
    if criterion.teacher_momentum is not None:  # same builder, same wrap policy as the student
        teacher = MomentumTeacher(
            build_teacher(build_model, cfg.MODEL, device, model),
            criterion.teacher_momentum,
            cfg.OPTIMIZER.num_epochs * iters_per_epoch,
        )
    step_batch = global_batch * settings.update_freq  # the linear scaling rule's batch
    note = lr_scaling_note(cfg.OPTIMIZER.param_schedulers.lr, step_batch)
    if note:
        logger.info(note)
    run = _Run(
        loader, model, criterion, optimizer, build_schedules(cfg.OPTIMIZER, iters_per_epoch, step_batch),
        settings, layout, cfg.OPTIMIZER.num_epochs, teacher,
    )  # fmt: skip
    run.probe = build_online_probe(cfg, loader.dataset, device)
    return run


def _train_epochs(cfg, run: _Run, iteration: int) -> None:
    """The loop, from ``iteration`` to the last epoch: per batch set the lr, forward and backward
    (accumulating), step at the end of each accumulation group, log, checkpoint."""
    model, criterion, optimizer, settings = run.model, run.criterion, run.optimizer, run.settings
    iters_per_epoch = run.layout.iters_per_epoch
    meter = TrainingMeter(
        cfg.CHECKPOINT.DIR, cfg.LOG_FREQUENCY, run.total_iterations, settings.device, settings.scaling,
        tracking=wandb_settings(cfg),
    )  # fmt: skip
    stop = BoundaryStop(cfg, run.total_iterations)  # SIGTERM / SIGUSR1: stop and save at a boundary
    watched = run.watched(cfg.BENCHMARK.WEIGHTS_FROM)
    monitor = Monitor(cfg, watched, meter, run.num_epochs, settings.device, iteration, run.probe)
    monitor.measure_baseline()  # a fresh run: the kNN of the trunk as it starts, the bar to beat
    if iteration and iteration % iters_per_epoch == 0:  # its checkpoint came before that epoch's pass
        monitor.after_epoch(iteration // iters_per_epoch, iteration)
    if meter.writer is not None:  # rank 0: what the loss compares, before the first step
        transforms = cfg.DATA.TRAIN.TRANSFORMS
        views = view_sheet(run.loader.dataset, side=max(128, *transforms.SIZE_CROPS))
        save_picture(views, cfg.CHECKPOINT.DIR, "views.png", meter.writer, "train/views", iteration)
    saved_at = iteration
    start_epoch, skip = divmod(iteration, iters_per_epoch)
    for epoch in range(start_epoch, run.num_epochs):
        set_epoch(run.loader, epoch, start_iteration=skip if epoch == start_epoch else 0)
        criterion.set_epoch(epoch)
        for batch, waited in timed(run.loader):  # waited: seconds this step waited for its batch
            lr = run.schedules.apply(optimizer, iteration)  # the step's lr and weight decay
            group = _accumulation_group(
                iteration - epoch * iters_per_epoch, iters_per_epoch, settings.update_freq
            )
            if settings.in_backward is not None and group.is_last:
                settings.in_backward.freeze(criterion.frozen_params(model, iteration))
            criterion.set_iteration(iteration, cfg.SEED_VALUE)
            criterion.set_batch(batch)
            loss = _forward_backward(
                model, criterion, batch, settings, group, (cfg.CHECKPOINT.DIR, iteration), run.teacher
            )
            meter.update(
                loss, batch["index"].shape[0], num_skipped=batch.get("num_skipped", 0), data_time=waited
            )
            if group.is_last:
                _optimizer_step(model, criterion, optimizer, settings, iteration)
                if run.teacher is not None:
                    run.teacher.update(model, iteration)  # t = m t + (1 - m) s on local shards
            iteration += 1
            if meter.should_log(iteration):
                meter.log(iteration, epoch, run.num_epochs, lr)
            if group.is_last and _crossed(saved_at, iteration, cfg.CHECKPOINT.CHECKPOINT_ITER_FREQUENCY):
                saved_at = _checkpoint(cfg, meter, run, iteration)
            if group.is_last and stop.requested():
                stop.save_and_stop(
                    iteration, saved_at, functools.partial(_checkpoint, cfg, meter, run, iteration)
                )
        last_epoch = epoch + 1 == run.num_epochs
        if saved_at != iteration and (last_epoch or _every(epoch + 1, cfg.CHECKPOINT.CHECKPOINT_FREQUENCY)):
            saved_at = _checkpoint(cfg, meter, run, iteration)
        monitor.after_epoch(epoch + 1, iteration)  # kNN, RankMe, feature std every MONITOR.EVERY_EPOCHS
    meter.summary()


# --------------------------------------------------------------------------------------------
# the step


@dataclasses.dataclass(frozen=True)
class _Group:
    """The gradient-accumulation group of one micro-batch."""

    size: int  # micro-batches in the group (fewer than update_freq at the end of an epoch)
    is_last: bool  # this micro-batch completes the group: sync gradients and step


def _accumulation_group(in_epoch: int, iters_per_epoch: int, update_freq: int) -> _Group:
    start = in_epoch // update_freq * update_freq
    size = min(update_freq, iters_per_epoch - start)
    return _Group(size=size, is_last=in_epoch + 1 == start + size)


class PartlyUpdatedError(InputError):
    """A backward failed after the step in backward had updated some units: training stops in
    one line (the checkpoints on disk are whole; a rerun resumes from the last one)."""

    kind = "training stopped"


def _forward_backward(
    model: nn.Module,
    criterion,
    batch: dict,
    s: StepSettings,
    group: _Group,
    where: Tuple[str, int],
    teacher: Optional[MomentumTeacher] = None,
) -> torch.Tensor:
    """Forward + loss under autocast, backward of loss / group size. Returns the (unscaled) loss.
    ``where``: (run folder, iteration), named if a failed backward left the model partly updated.
    The teacher (no_grad, resharded after) runs first: its gathered units are freed before the
    student's forward keeps any."""
    crops = [
        c.to(s.device, non_blocking=True).contiguous(memory_format=s.memory_format) for c in batch["crops"]
    ]
    # DDP and the sharded engine skip the gradient all-reduce / reduce-scatter inside no_sync()
    sync = contextlib.nullcontext() if group.is_last else model.no_sync()
    with sync:
        with torch.autocast(
            s.device.type, dtype=s.amp_dtype or torch.float32, enabled=s.amp_dtype is not None
        ):
            student = criterion.student_crops(crops)
            masking, targets = criterion.masking(student), None  # the masks first: the teacher may read them
            if teacher is not None:
                targets = teacher(criterion.teacher_crops(crops), **criterion.teacher_masking())
            loss = criterion(model(student, **masking), len(crops), targets)
        # dividing by the group size makes the accumulated gradient the mean over its micro-batches
        scaled = loss / group.size
        try:
            (s.scaling.scaler.scale(scaled) if s.scaling is not None else scaled).backward()
        except Exception as error:
            if s.in_backward is not None:
                _stop_if_partly_updated(model, error, *where)
            raise
    return loss.detach()


def _stop_if_partly_updated(model: nn.Module, error: Exception, run_dir: str, iteration: int) -> None:
    """With the step in backward: raise :class:`PartlyUpdatedError` (one line) when ``error``
    stopped a backward after some units stepped; the original traceback goes to the log."""
    try:
        model.reset_iter_state()
        return  # nothing had stepped: the original error stands
    except PartialStepError as partial:
        stepped = partial.stepped_units
    except Exception:  # recovery failed too (peers gone): the original error says more
        return
    logger.error("the backward failed", exc_info=error)
    latest = find_latest_checkpoint(run_dir)
    resume = f"from {latest}" if latest else f"from the start (no checkpoint in {run_dir} yet)"
    first_line = (str(error).splitlines() or [""])[0]
    raise PartlyUpdatedError(
        f"the backward of iteration {iteration + 1} failed ({type(error).__name__}: {first_line}) after the "
        f"step in backward had updated units {', '.join(stepped)}: the weights are partly updated and "
        f"were not saved; rerun the same command to resume {resume}"
    ) from error


def _optimizer_step(model: nn.Module, criterion, optimizer, s: StepSettings, iteration: int) -> None:
    if s.in_backward is not None:  # every shard stepped inside backward
        criterion.after_optimizer_step(model)
        return
    criterion.before_optimizer_step(model, iteration)
    if s.clip_grad_norm > 0:
        if s.scaling is not None:
            s.scaling.scaler.unscale_(optimizer)  # clip the true gradients, not the scaled ones
        clip_gradients(model, s.clip_grad_norm, s.clip_per_parameter)  # global, or DINO's per parameter
    if s.scaling is not None:
        s.scaling.step(optimizer)  # skipped when some rank found an inf/NaN gradient
    else:
        optimizer.step()
    criterion.after_optimizer_step(model)
    optimizer.zero_grad(set_to_none=True)


# --------------------------------------------------------------------------------------------
# setup helpers


def _this_device(cfg) -> torch.device:
    """This rank's device (the launcher set the CUDA one)."""
    if resolve_device(cfg.MACHINE) == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _step_settings(cfg, model: nn.Module, optimizer, device: torch.device) -> StepSettings:
    amp_dtype = precision.amp_dtype(cfg.MODEL)  # name and device were checked before launch
    update_freq = cfg.OPTIMIZER.update_freq
    scaling = precision.loss_scaling(model, cfg.MODEL, device)
    # checked before launch: the built-in engine, no clipping, no fp16 scaler
    in_backward = apply_optimizer_in_backward(model, optimizer) if cfg.OPTIMIZER.step_in_backward else None
    memory_format = torch.channels_last if cfg.MODEL.CHANNELS_LAST else torch.contiguous_format
    return StepSettings(
        device,
        amp_dtype,
        scaling,
        update_freq,
        float(cfg.OPTIMIZER.clip_grad_norm),
        in_backward,
        memory_format,
        clip_per_parameter=bool(cfg.OPTIMIZER.clip_grad_per_parameter),
    )


# --------------------------------------------------------------------------------------------
# checkpoints


def _every(count: int, frequency: int) -> bool:
    return frequency > 0 and count % frequency == 0


def _crossed(saved_at: int, iteration: int, frequency: int) -> bool:
    """A multiple of ``frequency`` lies in (saved_at, iteration] (accumulation may step past it)."""
    return frequency > 0 and iteration // frequency > saved_at // frequency


def _checkpoint(cfg, meter, run: _Run, iteration: int) -> int:
    """Save ``checkpoint_<iteration>`` (collective); returns ``iteration``."""
    layout, scaling = run.layout, run.settings.scaling
    epoch, in_epoch = divmod(iteration, layout.iters_per_epoch)
    # never save a run that diverged: the loss window, and the weights (a step can make them NaN
    # before any loss shows it)
    meter.check_finite(iteration, epoch)
    _check_finite_weights(run.model, iteration, cfg.CHECKPOINT.DIR)
    extra = {"loss": run.criterion.state_dict()}  # per rank: the SwAV queue differs between ranks
    if scaling is not None:
        extra.update(scaling.state_dict())  # "grad_scaler", "skipped_steps": an exact resume
    if run.probe is not None:
        extra["probe"] = run.probe.state_dict()  # equal on every rank
    meta = {
        "epoch": epoch,
        "iteration_in_epoch": in_epoch,
        "samples_seen": layout.samples_seen(epoch, in_epoch),  # what ranks checkpoints (files.py)
        **layout.as_meta(),
        "config": cfg.dump(),
    }
    path = save_sharded_checkpoint(
        cfg.CHECKPOINT.DIR,
        iteration,
        run.checkpointed_models(),
        run.optimizer,
        extra,
        meta,
        keep_last=cfg.CHECKPOINT.KEEP_LAST,
    )
    logger.info(f"saved {path}")
    return iteration


def _check_finite_weights(model: nn.Module, iteration: int, run_dir: str) -> None:
    """Collective: raise on every rank if any rank's parameters (or shards) hold NaN/inf."""
    bad = torch.zeros(1, device=next(model.parameters()).device)
    torch_sharded = backend_of(model) is Backend.TORCH
    for param in model.parameters():
        local = param.to_local() if torch_sharded else param  # fully_shard: DTensor shards
        bad += (~torch.isfinite(local.detach())).any()
    if comm.all_reduce_sum(bad).item() > 0:
        raise NonFiniteLossError(
            divergence_message("model weights became nan/inf", iteration, run_dir), agreed=True
        )
