"""Learning-rate and weight-decay schedules on fvcore's param schedulers, per global iteration.

fvcore schedulers map training progress ``where`` in [0, 1) to a value. We convert a global
iteration to ``where = iteration / (num_epochs * iterations_per_epoch)`` and put an optional
linear warm-up before the main schedule (cosine, multistep or constant).

The warm-up is indexed by the step it ends with: of W warm-up iterations (fractions allowed),
step ``t`` trains at ``start + (base - start) * min((t + 1) / W, 1)``, so the first step already
moves (``start_warmup_value`` is 0 by default: indexed by its start, a one-step run would train at
lr 0 throughout) and the last warm-up step trains at ``base_value``.
"""

import dataclasses
from typing import Callable, Dict, Optional

from fvcore.common.param_scheduler import (
    ConstantParamScheduler,
    CosineParamScheduler,
    MultiStepParamScheduler,
    ParamScheduler,
)
from torch.optim import Optimizer

from vistrain.config.errors import ConfigError

# fvcore's constant schedule rejects where >= 1; just below 1 the cosine is end_value to ~1e-17.
_LAST_WHERE = 1.0 - 1e-9


def _cosine(lr_cfg, num_epochs: float, iters_per_epoch: int) -> ParamScheduler:
    """Half cosine from base_value (end of warmup) to end_value (end of training)."""
    del num_epochs, iters_per_epoch
    return CosineParamScheduler(float(lr_cfg.base_value), float(lr_cfg.end_value))


def _multistep(lr_cfg, num_epochs: float, iters_per_epoch: int) -> ParamScheduler:
    """base_value * gamma**k after the k-th milestone (epochs from the start of training)."""
    epochs = [float(m) for m in lr_cfg.milestones]
    if any(b <= a for a, b in zip([0.0] + epochs, epochs)):
        raise ValueError(f"multistep milestones must be increasing and > 0, got {epochs}")
    if epochs and epochs[-1] >= num_epochs:
        raise ValueError(f"multistep milestone {epochs[-1]} must be below num_epochs={num_epochs}")
    milestones = [round(m * iters_per_epoch) for m in epochs]
    values = [float(lr_cfg.base_value) * float(lr_cfg.gamma) ** k for k in range(len(epochs) + 1)]
    total_iters = round(num_epochs * iters_per_epoch)
    return MultiStepParamScheduler(values, num_updates=total_iters, milestones=milestones)


def _constant(lr_cfg, num_epochs: float, iters_per_epoch: int) -> ParamScheduler:
    del num_epochs, iters_per_epoch
    return ConstantParamScheduler(float(lr_cfg.base_value))


# name -> (builder(lr_cfg, num_epochs, iters_per_epoch), whether it is rescaled after a warm-up).
# Cosine is rescaled so it starts at base_value when the warm-up ends; multistep is not, so its
# milestones stay absolute epochs.
SCHEDULES: Dict[str, tuple] = {
    "cosine": (_cosine, True),
    "multistep": (_multistep, False),
    "constant": (_constant, False),
}


@dataclasses.dataclass(frozen=True)
class Warmup:
    """A linear ramp from ``start`` to ``peak`` over ``iterations`` (fractions allowed)."""

    iterations: float
    start: float
    peak: float

    def __call__(self, iteration: int) -> float:
        """The lr of step ``iteration`` (0-based): the ramp's value where that step ends."""
        return self.start + (self.peak - self.start) * min((iteration + 1) / self.iterations, 1.0)


class LRSchedule:
    """Callable ``iteration -> lr`` over ``total_iters`` iterations (later ones: the final lr):
    ``warmup`` for the iterations below its length, then ``scheduler`` at the progress since the
    warm-up's end (``rescaled``) or since the start; every value times ``scale`` (the linear
    scaling rule, :func:`lr_scale`)."""

    def __init__(
        self,
        scheduler: ParamScheduler,
        total_iters: int,
        warmup: Optional[Warmup] = None,
        rescaled: bool = True,
        scale: float = 1.0,
    ):
        self.scheduler = scheduler
        self.total_iters = total_iters
        self.warmup = warmup
        self.rescaled = rescaled
        self.scale = scale

    @property
    def peak(self) -> float:
        """The lr where the main schedule starts, the end of the warm-up: ``base_value`` x ``scale``."""
        return self.scale * float(self.scheduler(0.0))

    def __call__(self, iteration: int) -> float:
        if iteration < 0:
            raise ValueError(f"iteration must be >= 0, got {iteration}")
        done = self.warmup.iterations if self.warmup is not None else 0.0
        if iteration < done:
            return self.scale * self.warmup(iteration)
        if self.rescaled:
            where = (iteration - done) / (self.total_iters - done)
        else:
            where = iteration / self.total_iters
        return self.scale * float(self.scheduler(min(where, _LAST_WHERE)))


def lr_scale(lr_cfg, global_batch: Optional[int]) -> float:
    """The linear scaling rule's factor (Goyal et al. 2017: "when the minibatch size is multiplied
    by k, multiply the learning rate by k"): ``global_batch / base_lr_batch_size`` with
    ``lr_cfg.auto_lr_scaling.auto_scale``, else 1. ``global_batch``: the images of one optimizer
    step, ranks x per-rank batch x update_freq."""
    scaling = lr_cfg.auto_lr_scaling
    if not scaling.auto_scale:
        return 1.0
    if global_batch is None or global_batch <= 0 or scaling.base_lr_batch_size <= 0:
        raise ValueError(
            f"the linear scaling rule needs a global batch and base_lr_batch_size > 0, got "
            f"{global_batch} and {scaling.base_lr_batch_size}"
        )
    return global_batch / scaling.base_lr_batch_size


def lr_scaling_note(lr_cfg, global_batch: int) -> Optional[str]:
    """One line on the scaled lr for the run's log, None without the scaling rule."""
    scale = lr_scale(lr_cfg, global_batch)
    if not lr_cfg.auto_lr_scaling.auto_scale:
        return None
    base, size = float(lr_cfg.base_value), lr_cfg.auto_lr_scaling.base_lr_batch_size
    return (
        f"lr: base_value {base:g} x global batch {global_batch} / {size} = {base * scale:g} "
        f"(OPTIMIZER.param_schedulers.lr.auto_lr_scaling; end_value and warm-up scaled alike)"
    )


def build_lr_schedule(
    opt_cfg, iterations_per_epoch: int, global_batch: Optional[int] = None
) -> Callable[[int], float]:
    """lr at a global iteration from ``opt_cfg.param_schedulers.lr`` (``cfg.OPTIMIZER``).

    Linear warm-up from ``start_warmup_value`` to ``base_value`` over ``warmup_epochs`` (fractions
    allowed; indexed as the module docstring says), then ``name``: cosine ``base_value -> end_value``
    at the last iteration, multistep (``lr = base_value * gamma**k`` once ``k`` milestones, in
    epochs, have passed) or constant; every value scaled by :func:`lr_scale` of ``global_batch``.
    """
    lr_cfg, num_epochs = opt_cfg.param_schedulers.lr, float(opt_cfg.num_epochs)
    if iterations_per_epoch <= 0 or num_epochs <= 0:
        raise ValueError(
            f"need iterations_per_epoch > 0 and num_epochs > 0, got {iterations_per_epoch} "
            f"and {opt_cfg.num_epochs}"
        )
    if lr_cfg.name not in SCHEDULES:
        raise ValueError(f"unknown lr schedule '{lr_cfg.name}'; valid: {sorted(SCHEDULES)}")
    build, rescaled = SCHEDULES[lr_cfg.name]
    main = build(lr_cfg, num_epochs, iterations_per_epoch)
    warmup_epochs = float(lr_cfg.warmup_epochs)
    if not 0 <= warmup_epochs < num_epochs:
        raise ValueError(
            f"warmup_epochs must be in [0, num_epochs={opt_cfg.num_epochs}), got {warmup_epochs}"
        )
    warmup = None
    if warmup_epochs > 0:
        warmup = Warmup(
            warmup_epochs * iterations_per_epoch, float(lr_cfg.start_warmup_value), float(lr_cfg.base_value)
        )
    scale = lr_scale(lr_cfg, global_batch)
    return LRSchedule(main, round(num_epochs * iterations_per_epoch), warmup, rescaled, scale)


def build_weight_decay_schedule(opt_cfg, iterations_per_epoch: int) -> Optional[LRSchedule]:
    """``iteration -> weight decay`` of ``opt_cfg.param_schedulers.weight_decay``; None for
    "constant" (the groups keep ``OPTIMIZER.weight_decay``). "cosine": DINO's ``cosine_scheduler``
    (no warm-up), ``end + (base - end) (1 + cos(pi i / T)) / 2`` at step i of T, base
    ``OPTIMIZER.weight_decay``."""
    wd_cfg = opt_cfg.param_schedulers.weight_decay
    if wd_cfg.name == "constant":
        return None
    if wd_cfg.name != "cosine":
        raise ValueError(f"unknown weight_decay schedule '{wd_cfg.name}'; valid: constant, cosine")
    cosine = CosineParamScheduler(float(opt_cfg.weight_decay), float(wd_cfg.end_value))
    return LRSchedule(cosine, round(float(opt_cfg.num_epochs) * iterations_per_epoch))


class ParamSchedules:
    """``OPTIMIZER.param_schedulers``: the lr's (:func:`build_lr_schedule`) and the weight
    decay's (:func:`build_weight_decay_schedule`, None: constant); ``apply(optimizer, iteration)``
    sets both for the step and returns the lr."""

    def __init__(self, lr: LRSchedule, weight_decay: Optional[LRSchedule] = None):
        self.lr, self.weight_decay = lr, weight_decay

    def apply(self, optimizer: Optimizer, iteration: int) -> float:
        lr = self.lr(iteration)
        set_lr(optimizer, lr, self.lr.peak)
        if self.weight_decay is not None:
            set_weight_decay(optimizer, self.weight_decay(iteration))
        return lr


def build_schedules(opt_cfg, iterations_per_epoch: int, global_batch: Optional[int] = None) -> ParamSchedules:
    """The :class:`ParamSchedules` of ``opt_cfg`` (``cfg.OPTIMIZER``) for a training run."""
    return ParamSchedules(
        build_lr_schedule(opt_cfg, iterations_per_epoch, global_batch),
        build_weight_decay_schedule(opt_cfg, iterations_per_epoch),
    )


def set_weight_decay(optimizer: Optimizer, weight_decay: float) -> None:
    """Set every group's weight decay to ``weight_decay * group["weight_decay_multiplier"]`` (1
    for the groups that decay, 0 for the others; a group loaded without it: 1 if it decays now)."""
    for group in optimizer.param_groups:
        multiplier = group.setdefault("weight_decay_multiplier", float(group["weight_decay"] > 0))
        group["weight_decay"] = weight_decay * multiplier


def set_lr(optimizer: Optimizer, lr: float, peak: Optional[float] = None) -> None:
    """Set every group's lr to ``lr * group["lr_multiplier"]`` (multiplier 1 when absent); a group
    with ``fixed_lr`` (``OPTIMIZER.fixed_lr_params``) gets ``peak * lr_multiplier`` instead, the
    schedule's :attr:`LRSchedule.peak`. ConfigError for such a group without ``peak`` (the
    benchmarks' loops have none)."""
    for group in optimizer.param_groups:
        value = lr
        if group.get("fixed_lr", False):
            if peak is None:
                raise ConfigError("OPTIMIZER.fixed_lr_params is for pretraining (JOB train): set it to []")
            value = peak
        group["lr"] = value * group.get("lr_multiplier", 1.0)
