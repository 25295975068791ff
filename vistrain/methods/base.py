"""What a method file provides: a :class:`Method` record (its criterion class, its :class:`Head`,
its config section, rules and checks, whether it trains a momentum teacher, its loss collectives)
and the :class:`Criterion` base class its criterion extends.

Nothing here names a method; ``vistrain/methods/registry.py`` registers the records by name.
"""

import dataclasses
import functools
from typing import Callable, Dict, List, Mapping, NamedTuple, Optional, Sequence, Tuple, Type

import torch
from fvcore.common.config import CfgNode
from torch import nn

from vistrain.config.checks import Problem
from vistrain.config.warmups import Warmup


class Criterion(nn.Module):
    """A method's criterion: ``forward(model_output, num_crops, teacher_output=None) -> scalar``.

    It adapts the pure losses of ``vistrain/losses/`` to the SSL model's output, owns the method's
    state (its ``state_dict()`` goes into every checkpoint, per rank) and says which crops go
    where. The training loop calls it explicitly and never branches on a method::

        criterion.set_iteration(iteration, cfg.SEED_VALUE)
        criterion.set_batch(batch)                           # its labels, for a method that reads them
        student = criterion.student_crops(crops)
        masking = criterion.masking(student)
        if criterion.teacher_momentum:
            targets = teacher(criterion.teacher_crops(crops), **criterion.teacher_masking())
        loss = criterion(model(student, **masking), len(crops), targets)
        loss.backward()
        criterion.before_optimizer_step(model, iteration)   # drops frozen_params' gradients
        optimizer.step()
        criterion.after_optimizer_step(model)
        teacher.update(model, iteration)                     # the EMA (losses/teacher.py)

    With the optimizer step inside backward the loop hands ``frozen_params(model, iteration)`` to
    the engine before backward instead, and calls ``after_optimizer_step`` once backward returns.
    The hooks below are no-ops. ``teacher_momentum``: m0 of the momentum teacher's cosine schedule
    (``vistrain.losses.teacher``), None without a teacher.
    """

    teacher_momentum: Optional[float] = None

    def student_crops(self, crops: Sequence[torch.Tensor]) -> Sequence[torch.Tensor]:
        """The crops the student sees (all of them by default)."""
        return crops

    def masking(self, crops: Sequence[torch.Tensor]) -> Dict[str, torch.Tensor]:
        """Masks for the student's ``crops`` (``model(crops, **masking)``: the trunk's ``keep=`` or
        ``mask=``, drawn from the run's RNG); none by default."""
        return {}

    def teacher_crops(self, crops: Sequence[torch.Tensor]) -> Sequence[torch.Tensor]:
        """The crops the teacher sees, when there is one (all of them by default)."""
        return crops

    def teacher_masking(self) -> Dict[str, object]:
        """What the teacher's model takes of the last :meth:`masking` (``teacher(crops,
        **teacher_masking())``; DINOv2: ``head_mask``, the student's masks for the teacher's head
        alone); none by default."""
        return {}

    def load_shared_state(self, state: dict) -> None:
        """Load the part of a saved ``state_dict()`` that every rank holds alike (e.g. a centre),
        from a checkpoint saved on another world size; per-rank state (a queue) starts afresh."""

    def set_epoch(self, epoch: int) -> None:
        """Called at the start of every epoch."""

    def set_iteration(self, iteration: int, seed: int) -> None:
        """Called before every forward with the iterations completed so far (equal on every rank,
        and the same again after a resume) and the run's SEED_VALUE: what a method needs to draw
        random numbers that every rank draws alike (LeJEPA's slice directions)."""

    def set_batch(self, batch: dict) -> None:
        """Called before every forward with the loader's batch (``"crops"``, ``"label"`` (B,) int64
        with -1 for an image without a label, ``"index"``): what a method that learns from labels
        reads (``vistrain.data.labels``); ignored by the self-supervised ones."""

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


def no_keys() -> CfgNode:
    return CfgNode()


@dataclasses.dataclass(frozen=True)
class Head:
    """A head, registered under its ``MODEL.HEAD.NAME``.

    ``build(MODEL.HEAD) -> nn.Module``: a module that declares ``in_feature`` (the trunk feature it
    reads, ``"avgpool"``; ``vistrain.models.SSLModel``) and raises ConfigError for settings it
    cannot take. ``keys()``: the MODEL.HEAD keys it reads besides NAME, DIMS and USE_BN, with their
    defaults (a comment per key); a key several heads read has one default. ``fp32_units``: module
    classes the wrap policy makes separate units kept in full precision (``vistrain.models.units``).
    ``sized_by_trunk``: ``build(MODEL.HEAD, trunk)`` instead (MAE's decoder reads the patch grid,
    MoCo v3's predictor whether the trunk is a ViT).
    """

    name: str
    build: Callable[..., nn.Module]
    keys: Callable[[], CfgNode] = no_keys
    fp32_units: Tuple[Type[nn.Module], ...] = ()
    sized_by_trunk: bool = False


class LossCollective(NamedTuple):
    """A collective over every rank that the loss runs in each step (for the planner's traffic):
    ``op`` all_gather | all_reduce | broadcast, of ``nbytes`` per rank, ``calls`` times."""

    op: str
    nbytes: int
    calls: int


def no_collectives(cfg: CfgNode, world: int) -> List[LossCollective]:
    return []


def no_loss_memory(cfg: CfgNode) -> int:
    return 0


def gathered_view_collectives(cfg: CfgNode, world: int) -> List[LossCollective]:
    """Each of two views' embeddings all-gathered (B, D) in fp32, and their gradient all-reduced
    (losses on statistics of the global batch: Barlow Twins, VICReg)."""
    view = world * cfg.DATA.TRAIN.BATCHSIZE_PER_REPLICA * cfg.MODEL.HEAD.DIMS[-1] * 4
    return [LossCollective(op, view, 2) for op in ("all_gather", "all_reduce")]


def square_matrices_memory(count: int) -> Callable[[CfgNode], int]:
    """``loss_memory`` of a loss whose peak holds ``count`` (D, D) fp32 matrices, D the head's
    output width."""
    return functools.partial(_square_matrices_bytes, count)


def _square_matrices_bytes(count: int, cfg: CfgNode) -> int:
    return count * cfg.MODEL.HEAD.DIMS[-1] ** 2 * 4


def two_views(model_output, num_crops: int, loss: str) -> Tuple[torch.Tensor, torch.Tensor]:
    """The (N, D) embeddings of each view from a (2N, D) head output; one line if it is not."""
    if num_crops != 2:
        raise ValueError(f"{loss} needs exactly 2 crops per image, got {num_crops}")
    if not isinstance(model_output, torch.Tensor) or model_output.shape[0] % 2:
        head = loss.removesuffix("_loss")
        raise ValueError(f"{loss} expects a (2N, D) embedding tensor from a {head} head")
    z_a, z_b = model_output.chunk(2)
    return z_a, z_b


Rule = Callable[..., Problem]  # vistrain.config.checks' rules: (value, catalog) -> Problem


@dataclasses.dataclass(frozen=True)
class Method:
    """A method, registered under its ``LOSS.NAME``.

    ``criterion(LOSS.<name>, MODEL) -> Criterion`` (the class itself, usually; MODEL may be None
    when it reads none: DINO reads its head's width, MAE its trunk's patches). ``head``: the head it reads (MODEL.HEAD.NAME must name it).
    ``section()``: LOSS.<name>, every key with its default and a comment. ``rules``: key of the
    section -> the rules of ``vistrain.config.checks`` its value must pass (checked for every
    method's section, as every other key). ``checks``: functions of the whole config -> a one-line
    problem or None, run for the chosen method before the ranks start and when it is built.
    ``teacher``: it trains a momentum teacher (built and wrapped like the student; the planner
    counts its shards). ``min_crops`` / ``max_crops``: the crops per image it takes.
    ``collectives(cfg, world)``: the loss's own collectives in one step. ``loss_memory(cfg)``:
    the bytes per rank its loss adds at its peak to the model's activations (what autograd saves
    and the backward's temporaries), where they are not small beside them (the planner).
    ``warmups``: keys of its section that are warm-up lengths (``vistrain.config.warmups.Warmup``,
    the key within the section): a short run shortens those that would outlast it.
    """

    name: str
    criterion: Callable[[CfgNode, Optional[CfgNode]], Criterion]
    head: Head
    section: Callable[[], CfgNode]
    rules: Mapping[str, Sequence[Rule]] = dataclasses.field(default_factory=dict)
    checks: Tuple[Callable[[CfgNode], Problem], ...] = ()
    teacher: bool = False
    min_crops: int = 2
    max_crops: Optional[int] = None
    collectives: Callable[[CfgNode, int], List[LossCollective]] = no_collectives
    loss_memory: Callable[[CfgNode], int] = no_loss_memory
    warmups: Tuple[Warmup, ...] = ()


# --------------------------------------------------------------------------------------------
# helpers several methods use


def modules_of(model: nn.Module, cls: type, head: str) -> List[nn.Module]:
    """Every ``cls`` module of ``model``; ValueError when it has none (the wrong head)."""
    found = [m for m in model.modules() if isinstance(m, cls)]
    if not found:
        raise ValueError(f"this method needs a model with a {head} head (no {cls.__name__} module found)")
    return found


def global_crops_fit(cfg: CfgNode) -> Problem:
    """A method check: the section's ``num_global_crops`` must be crops DATA.TRAIN makes."""
    transforms, section = cfg.DATA.TRAIN.TRANSFORMS, cfg.LOSS[cfg.LOSS.NAME]
    crops, wanted = sum(transforms.NUM_CROPS), section.num_global_crops
    if transforms.NAME == "multicrop" and wanted > crops:
        return (
            f"LOSS.{cfg.LOSS.NAME}.num_global_crops={wanted}, but DATA.TRAIN.TRANSFORMS.NUM_CROPS="
            f"{list(transforms.NUM_CROPS)} makes {crops} crops: set num_global_crops to at most {crops}"
        )
    return None
