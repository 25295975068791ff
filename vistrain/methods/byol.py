"""BYOL (Grill et al., 2020): the online network's prediction of the momentum teacher's projection
of the other view, symmetrised (``vistrain/losses/byol.py``); head "byol": a projector and a
predictor MLP. Exactly two crops per image."""

from typing import Sequence, Tuple

import torch
from fvcore.common.config import CfgNode
from torch import nn

from vistrain.config.errors import ConfigError
from vistrain.losses.byol import symmetric_byol_loss
from vistrain.methods.base import Criterion, Head, Method
from vistrain.models.heads.mlp import MLP


def section() -> CfgNode:
    """LOSS.byol_loss."""
    c = CfgNode()
    c.momentum_teacher = 0.996  # m0: cosine from m0 to 1 over the run
    return c


def head_keys() -> CfgNode:
    """MODEL.HEAD keys of the byol head."""
    c = CfgNode()
    c.PREDICTOR_DIMS = [128, 512, 128]  # byol, moco_v3: predictor MLP dims (first = DIMS[-1])
    return c


class BYOLHead(nn.Module):
    """``forward(x)``: x (N, dims[0]) -> (projection z (N, D), prediction q(z) (N, D)).

    BYOL: the online network's projector g and predictor q are MLPs (Linear, BatchNorm, ReLU,
    Linear; 4096 hidden, 256 out). The target network is built by the same builder (so it holds a
    predictor too, averaged but unused): the loss reads the student's prediction and the teacher's
    projection.
    """

    in_feature = "avgpool"

    def __init__(self, dims: Sequence[int], predictor_dims: Sequence[int], use_bn: bool):
        super().__init__()
        self.projection = MLP(dims, use_bn)
        if int(predictor_dims[0]) != self.projection.dims[-1]:
            raise ConfigError(
                f"MODEL.HEAD.PREDICTOR_DIMS[0] must equal MODEL.HEAD.DIMS[-1] ({self.projection.dims[-1]}), "
                f"got {predictor_dims[0]}"
            )
        self.predictor = MLP(predictor_dims, use_bn)

    def forward(self, x: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        z = self.projection(x)
        return z, self.predictor(z)


def build_head(head_cfg) -> BYOLHead:
    return BYOLHead(head_cfg.DIMS, head_cfg.PREDICTOR_DIMS, head_cfg.USE_BN)


class BYOLCriterion(Criterion):
    """BYOL on ``(projections (2N, D), predictions (2N, D))`` of the student and the teacher's
    projections of the same two views: the symmetric loss L + L~ (``losses/byol.py``)."""

    def __init__(self, byol_cfg, model_cfg=None):
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


HEAD = Head("byol", build_head, head_keys)

METHOD = Method(
    name="byol_loss",
    criterion=BYOLCriterion,
    head=HEAD,
    section=section,
    teacher=True,
    max_crops=2,
)
