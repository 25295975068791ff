"""Methods: ``build_method(cfg)`` -> SSLCriterion, the flat ``METHODS`` registry (LOSS.NAME).

A method is a head (``MODEL.HEAD.NAME``, checked here) + a loss (+ a momentum teacher). The losses
(SimCLRLoss, SwAVLoss, sinkhorn_knopp, DINOLoss, byol_loss) work on plain tensors, in one process
or under torch.distributed. The criteria adapt them to SSLModel outputs, own the method's state
(SwAV queue, prototype freezing and normalisation, DINO's centre and frozen last layer) and say
which crops go where; the training loop calls them explicitly and never branches on a name:

    targets = teacher(criterion.teacher_crops(crops)) if criterion.teacher_momentum else None
    loss = criterion(model(criterion.student_crops(crops)), len(crops), targets)
    loss.backward()
    criterion.before_optimizer_step(model, iteration)   # drops frozen_params' gradients
    optimizer.step()
    criterion.after_optimizer_step(model)
    teacher.update(model, iteration)                     # the EMA (losses/teacher.py)

With the optimizer step inside backward the loop hands ``frozen_params(model, iteration)`` to the
engine before backward instead, and calls ``after_optimizer_step`` once backward returns.
"""

import dataclasses
from typing import List, Optional, Sequence, Tuple

import torch
from torch import nn

from vistrain.config.errors import ConfigError
from vistrain.fsdp import gathered, params_of
from vistrain.losses.byol import byol_loss, symmetric_byol_loss
from vistrain.losses.dino import DINOLoss, teacher_temperature
from vistrain.losses.simclr import SimCLRLoss, mix_crops
from vistrain.losses.swav import SwAVLoss, sinkhorn_knopp
from vistrain.losses.teacher import MomentumTeacher, cosine_momentum
from vistrain.models.heads.dino import DINOLastLayer
from vistrain.models.heads.swav import SwAVPrototypes


class SSLCriterion(nn.Module):
    """Base adapter: ``forward(model_output, num_crops, teacher_output=None) -> scalar``; hooks
    are no-ops here. ``teacher_momentum``: m0 of a momentum teacher, None without one."""

    teacher_momentum: Optional[float] = None

    def student_crops(self, crops: Sequence[torch.Tensor]) -> Sequence[torch.Tensor]:
        """The crops the student sees (all of them by default)."""
        return crops

    def teacher_crops(self, crops: Sequence[torch.Tensor]) -> Sequence[torch.Tensor]:
        """The crops the teacher sees, when there is one (all of them by default)."""
        return crops

    def load_shared_state(self, state: dict) -> None:
        """Load the part of a saved ``state_dict()`` that every rank holds alike (DINO's centre),
        from a checkpoint saved on another world size; per-rank state (SwAV's queue) starts afresh."""

    def set_epoch(self, epoch: int) -> None:
        """Called at the start of every epoch."""

    def frozen_params(self, model: nn.Module, iteration: int) -> List[nn.Parameter]:
        """Parameters the optimizer must leave alone at this iteration (none by default)."""
        return []

    def before_optimizer_step(self, model: nn.Module, iteration: int) -> None:
        """Called after backward, before ``optimizer.step()``: frozen parameters lose their
        gradients, so the optimizer skips them (no momentum or weight decay either)."""
        for param in self.frozen_params(model, iteration):
            param.grad = None

    def after_optimizer_step(self, model: nn.Module) -> None:
        """Called right after ``optimizer.step()``."""


class SimCLRCriterion(SSLCriterion):
    """SimCLR on a (C*N, D) embedding tensor: rows [c*N, (c+1)*N) are crop c (C >= 2; with
    multi-crop every crop of an image is a positive of every other, ``losses/simclr.py``).
    With ``mix_alpha`` > 0 (i-Mix) ``student_crops`` mixes crop 0's images in pairs and the next
    ``forward`` scores that mixture with its virtual labels."""

    def __init__(self, simclr_cfg):
        super().__init__()
        self.loss = SimCLRLoss(
            simclr_cfg.temperature,
            int(simclr_cfg.num_global_crops),
            float(simclr_cfg.false_negative_prior),
            float(simclr_cfg.hardness),
        )
        self.mix_alpha = float(simclr_cfg.mix_alpha)
        self._mix = None  # (lam, partner) of the crops student_crops mixed last

    def student_crops(self, crops: Sequence[torch.Tensor]) -> Sequence[torch.Tensor]:
        if self.mix_alpha == 0.0:
            return crops
        mixed, lam, partner = mix_crops(crops[0], self.mix_alpha)
        self._mix = (lam, partner)
        return [mixed, *crops[1:]]

    def forward(self, model_output: torch.Tensor, num_crops: int, teacher_output=None) -> torch.Tensor:
        if num_crops < 2:
            raise ValueError(f"simclr_loss needs 2 or more crops per image, got {num_crops}")
        if not isinstance(model_output, torch.Tensor) or model_output.shape[0] % num_crops:
            raise ValueError(f"simclr_loss expects a ({num_crops}N, D) embedding tensor from a simclr head")
        mix, self._mix = self._mix, None
        if self.mix_alpha > 0.0 and mix is None:
            raise ValueError("simclr_loss with mix_alpha > 0 scores crops that student_crops mixed")
        return self.loss(*model_output.chunk(num_crops), mix=mix)


class SwAVCriterion(SSLCriterion):
    """SwAV on ``(embedding (C*N, D), [scores (C*N, K_j)])``: rows [c*N, (c+1)*N) are crop c.

    Prototype state goes through ``vistrain.fsdp.params_of`` / ``gathered`` so it also works
    when the prototypes are sharded. After every step the normalised prototypes are copied
    (only when a queue is configured) to score queued embeddings in the next forward; until the
    first ``after_optimizer_step`` (fresh start or resume) the queue is filled but not used.
    The queue itself is per rank and part of ``state_dict()`` (``loss._extra_state``).
    """

    def __init__(self, swav_cfg):
        super().__init__()
        self.loss = SwAVLoss(
            temperature=swav_cfg.temperature,
            epsilon=swav_cfg.epsilon,
            sinkhorn_iterations=swav_cfg.sinkhorn_iterations,
            crops_for_assign=swav_cfg.crops_for_assign,
            queue_length=swav_cfg.queue_length,
            start_queue_at_epoch=swav_cfg.start_queue_at_epoch,
        )
        self.freeze_prototypes_niters = swav_cfg.freeze_prototypes_niters
        self.prototype_weights = None  # List[(K_j, D)] after the last step, for the queue

    def forward(self, model_output, num_crops: int, teacher_output=None) -> torch.Tensor:
        if not isinstance(model_output, (tuple, list)) or len(model_output) != 2:
            raise ValueError("swav_loss expects (embedding, [scores]) from a swav head")
        embedding, scores = model_output
        if embedding.shape[0] % num_crops:
            raise ValueError(f"{embedding.shape[0]} rows do not split into {num_crops} equal crops")
        per_layer = [list(s.chunk(num_crops)) for s in scores]
        embeddings = list(embedding.chunk(num_crops)) if self.loss.queue_active else None
        return self.loss(per_layer, embeddings, self.prototype_weights)

    def set_epoch(self, epoch: int) -> None:
        self.loss.set_epoch(epoch)

    def frozen_params(self, model: nn.Module, iteration: int) -> List[nn.Parameter]:
        """SwAV: "freeze the prototypes during the first epoch" (their parameters, or shards)."""
        if iteration >= self.freeze_prototypes_niters:
            return []
        return [param for module in _prototype_modules(model) for param in params_of(module)]

    def after_optimizer_step(self, model: nn.Module) -> None:
        """Project the prototypes back onto the unit sphere (and keep a copy for the queue)."""

        weights = []
        for module in _prototype_modules(model):
            with gathered(module):
                module.normalize_()
                if self.loss.queue_length > 0:
                    weights.append(module.weight.detach().clone())
        self.prototype_weights = weights or None


def _prototype_modules(model: nn.Module) -> List[nn.Module]:
    found = [m for m in model.modules() if isinstance(m, SwAVPrototypes)]
    if not found:
        raise ValueError("swav_loss needs a model with a swav head (no SwAVPrototypes module found)")
    return found


class DINOCriterion(SSLCriterion):
    """DINO on logits (C*N, K): rows [c*N, (c+1)*N) are crop c, the ``num_global_crops`` first
    crops are the global ones; the teacher sees only those, (G*N, K).

    Per-step state: the centre (``loss.center``, equal on every rank: all-reduced), the teacher
    temperature (warm-up by epoch), the last layer frozen during the first
    ``freeze_last_layer_epochs`` epochs (DINO's ``cancel_gradients_last_layer``).
    """

    def __init__(self, dino_cfg, head_cfg):
        super().__init__()
        self.cfg = dino_cfg
        self.num_global_crops = int(dino_cfg.num_global_crops)
        self.teacher_momentum = float(dino_cfg.momentum_teacher)
        self.loss = DINOLoss(int(head_cfg.OUT_DIM), dino_cfg.student_temp, dino_cfg.center_momentum)
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def teacher_temp(self) -> float:
        c = self.cfg
        return teacher_temperature(
            self.epoch, c.warmup_teacher_temp, c.teacher_temp, int(c.warmup_teacher_temp_epochs)
        )

    def teacher_crops(self, crops):
        return crops[: self.num_global_crops]

    def forward(self, model_output, num_crops: int, teacher_output=None) -> torch.Tensor:
        if teacher_output is None:
            raise ValueError("dino_loss needs the teacher's output")
        if num_crops < max(self.num_global_crops, 2):
            raise ValueError(
                f"dino_loss needs the {self.num_global_crops} global crops and at least 2 crops, got {num_crops}"
            )
        student = model_output.chunk(num_crops)
        teacher = teacher_output.chunk(self.num_global_crops)
        return self.loss(student, teacher, self.teacher_temp())

    def frozen_params(self, model: nn.Module, iteration: int) -> List[nn.Parameter]:
        if self.epoch >= self.cfg.freeze_last_layer_epochs:
            return []
        return [param for module in _modules_of(model, DINOLastLayer, "dino") for param in params_of(module)]

    def load_shared_state(self, state: dict) -> None:
        self.loss.center.copy_(state["loss.center"])


class BYOLCriterion(SSLCriterion):
    """BYOL on ``(projections (2N, D), predictions (2N, D))`` of the student and the teacher's
    projections of the same two views: the symmetric loss L + L~ (``losses/byol.py``)."""

    def __init__(self, byol_cfg, head_cfg):
        super().__init__()
        self.teacher_momentum = float(byol_cfg.momentum_teacher)

    def forward(self, model_output, num_crops: int, teacher_output=None) -> torch.Tensor:
        if num_crops != 2:
            raise ValueError(f"byol_loss needs exactly 2 crops per image, got {num_crops}")
        if teacher_output is None:
            raise ValueError("byol_loss needs the teacher's output")
        _, predictions = model_output
        targets, _ = teacher_output
        return symmetric_byol_loss(predictions.chunk(2), targets.chunk(2))


def _modules_of(model: nn.Module, cls: type, head: str) -> List[nn.Module]:
    found = [m for m in model.modules() if isinstance(m, cls)]
    if not found:
        raise ValueError(f"this method needs a model with a {head} head (no {cls.__name__} module found)")
    return found


@dataclasses.dataclass(frozen=True)
class Method:
    """A registry entry: the criterion class, the heads it reads (empty: any), whether it trains
    a momentum teacher (built like the student; the planner counts it), the crops per image it
    takes (at least ``min_crops``, at most ``max_crops`` when set)."""

    criterion: type
    heads: Tuple[str, ...] = ()
    teacher: bool = False
    min_crops: int = 2
    max_crops: Optional[int] = None


METHODS = {
    "simclr_loss": Method(SimCLRCriterion),
    "swav_loss": Method(SwAVCriterion),
    "dino_loss": Method(DINOCriterion, ("dino",), teacher=True),
    "byol_loss": Method(BYOLCriterion, ("byol",), teacher=True, max_crops=2),
}
LOSSES = METHODS  # the names LOSS.NAME accepts


def build_loss(loss_cfg, head_cfg=None) -> SSLCriterion:
    """Criterion for ``cfg.LOSS``: NAME picks the class, which reads only ``cfg.LOSS[NAME]`` (and,
    for methods with a teacher, ``cfg.MODEL.HEAD``)."""
    if loss_cfg.NAME not in METHODS:
        raise ValueError(f"unknown LOSS.NAME {loss_cfg.NAME!r}; valid names: {sorted(METHODS)}")
    method = METHODS[loss_cfg.NAME]
    if method.heads:
        if head_cfg is None:
            raise ValueError(f"{loss_cfg.NAME} needs MODEL.HEAD (build it with build_method(cfg))")
        return method.criterion(loss_cfg[loss_cfg.NAME], head_cfg)
    return method.criterion(loss_cfg[loss_cfg.NAME])


def build_method(cfg) -> SSLCriterion:
    """The method of ``cfg``: LOSS.NAME's criterion, after checking that MODEL.HEAD.NAME fits it."""
    method = METHODS.get(cfg.LOSS.NAME)
    if method is not None and method.heads and cfg.MODEL.HEAD.NAME not in method.heads:
        raise ConfigError(
            f"LOSS.NAME={cfg.LOSS.NAME} reads a {' or '.join(method.heads)} head: set "
            f"MODEL.HEAD.NAME={method.heads[0]} (now {cfg.MODEL.HEAD.NAME})"
        )
    _check_crops(cfg, method)
    _check_global_crops(cfg)
    _check_simclr_mix(cfg)
    return build_loss(cfg.LOSS, cfg.MODEL.HEAD)


def _check_crops(cfg, method: Optional[Method]) -> None:
    """Before the first step: the crops per image DATA.TRAIN makes must be ones the method takes."""
    transforms = cfg.DATA.TRAIN.TRANSFORMS
    if method is None or transforms.NAME != "multicrop":
        return
    crops = sum(transforms.NUM_CROPS)
    if crops < method.min_crops or (method.max_crops is not None and crops > method.max_crops):
        wanted = {None: f"{method.min_crops} or more", method.min_crops: f"exactly {method.min_crops}"}.get(
            method.max_crops, f"{method.min_crops} to {method.max_crops}"
        )
        raise ConfigError(
            f"LOSS.NAME={cfg.LOSS.NAME} takes {wanted} crops per image, but DATA.TRAIN.TRANSFORMS.NUM_CROPS="
            f"{list(transforms.NUM_CROPS)} makes {crops}: change NUM_CROPS (and SIZE_CROPS, CROP_SCALES)"
        )


def _check_global_crops(cfg) -> None:
    """A loss's ``num_global_crops`` (DINO's, SimCLR's) must be crops DATA.TRAIN makes."""
    transforms, section = cfg.DATA.TRAIN.TRANSFORMS, cfg.LOSS.get(cfg.LOSS.NAME, {})
    crops, wanted = sum(transforms.NUM_CROPS), section.get("num_global_crops", 0)
    if transforms.NAME == "multicrop" and wanted > crops:
        raise ConfigError(
            f"LOSS.{cfg.LOSS.NAME}.num_global_crops={wanted}, but DATA.TRAIN.TRANSFORMS.NUM_CROPS="
            f"{list(transforms.NUM_CROPS)} makes {crops} crops: set num_global_crops to at most {crops}"
        )


def _check_simclr_mix(cfg) -> None:
    """i-Mix mixes crop 0 and keys on the other crops; it is its own form of the loss."""
    simclr = cfg.LOSS.simclr_loss
    if cfg.LOSS.NAME != "simclr_loss" or simclr.mix_alpha == 0.0:
        return
    others = [key for key in ("num_global_crops", "false_negative_prior", "hardness") if simclr[key]]
    if others:
        raise ConfigError(
            f"LOSS.simclr_loss.mix_alpha={simclr.mix_alpha} is not combined with {', '.join(others)}: "
            "set them to 0 or mix_alpha to 0"
        )
    transforms = cfg.DATA.TRAIN.TRANSFORMS
    if transforms.NAME == "multicrop" and sum(transforms.NUM_CROPS) < 3:
        raise ConfigError(
            f"LOSS.simclr_loss.mix_alpha={simclr.mix_alpha} needs 3 or more crops per image (crop 0 mixed, "
            f"the others its keys), but DATA.TRAIN.TRANSFORMS.NUM_CROPS={list(transforms.NUM_CROPS)} makes "
            f"{sum(transforms.NUM_CROPS)}: add crops or set mix_alpha to 0"
        )


def has_teacher(loss_cfg) -> bool:
    """Whether LOSS.NAME trains a momentum teacher (the planner counts its parameters)."""
    return METHODS[loss_cfg.NAME].teacher


__all__ = [
    "BYOLCriterion",
    "DINOCriterion",
    "DINOLoss",
    "LOSSES",
    "METHODS",
    "Method",
    "MomentumTeacher",
    "SSLCriterion",
    "SimCLRCriterion",
    "SimCLRLoss",
    "SwAVCriterion",
    "SwAVLoss",
    "build_loss",
    "build_method",
    "byol_loss",
    "cosine_momentum",
    "has_teacher",
    "sinkhorn_knopp",
    "symmetric_byol_loss",
    "teacher_temperature",
]
