"""SimSiam (Chen and He, 2021): each view's prediction regressed onto the other view's projection
under a stop-gradient, by negative cosine similarity, symmetrised (``vistrain/losses/simsiam.py``);
head "simsiam": a projector with BatchNorm in every layer and a bottleneck predictor. No teacher,
no negatives; exactly two crops per image. The authors' constant predictor lr (``--fix-pred-lr``)
is ``OPTIMIZER.fixed_lr_params: [head.predictor]``."""

from typing import Sequence, Tuple

import torch
from fvcore.common.config import CfgNode
from torch import nn

from vistrain.config.errors import ConfigError
from vistrain.losses.simsiam import symmetric_simsiam_loss
from vistrain.methods.base import Criterion, Head, Method
from vistrain.models.heads.mlp import MLP


def section() -> CfgNode:
    """LOSS.simsiam_loss: SimSiam's loss has no setting (its predictor's constant lr is the
    optimizer's: OPTIMIZER.fixed_lr_params)."""
    return CfgNode()


def head_keys() -> CfgNode:
    """MODEL.HEAD keys of the simsiam head (the byol and moco_v3 heads read the same key)."""
    c = CfgNode()
    c.PREDICTOR_DIMS = [128, 512, 128]  # byol, moco_v3: predictor MLP dims (first = DIMS[-1])
    return c


class SimSiamHead(nn.Module):
    """``forward(x)``: x (N, dims[0]) -> (projection z (N, D), prediction p (N, D)).

    As the authors' ``builder.SimSiam``: the projector is ``DIMS`` (theirs [2048, 2048, 2048,
    2048]: 3 layers), BatchNorm after every Linear and ReLU after the hidden ones, the output's
    BatchNorm without affine parameters; the predictor ``PREDICTOR_DIMS`` (theirs [2048, 512,
    2048]: a bottleneck), Linear, BatchNorm, ReLU, Linear. Their Linears before a BatchNorm have no
    bias; ours have one, which the BatchNorm cancels (its gradient is 0 in training, its running
    mean absorbs it in eval).
    """

    in_feature = "avgpool"

    def __init__(self, dims: Sequence[int], predictor_dims: Sequence[int], use_bn: bool):
        super().__init__()
        self.projection = MLP(dims, use_bn, last_bn=True)
        if (
            int(predictor_dims[0]) != self.projection.dims[-1]
            or int(predictor_dims[-1]) != self.projection.dims[-1]
        ):
            raise ConfigError(
                f"MODEL.HEAD.PREDICTOR_DIMS must start and end with MODEL.HEAD.DIMS[-1] "
                f"({self.projection.dims[-1]}): the prediction is compared with the projection; got "
                f"{list(predictor_dims)}"
            )
        self.predictor = MLP(predictor_dims, use_bn)

    def forward(self, x: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        z = self.projection(x)
        return z, self.predictor(z)


def build_head(head_cfg) -> SimSiamHead:
    return SimSiamHead(head_cfg.DIMS, head_cfg.PREDICTOR_DIMS, head_cfg.USE_BN)


class SimSiamCriterion(Criterion):
    """SimSiam on ``(projections (2N, D), predictions (2N, D))``, rows [0, N) view 1 and [N, 2N)
    view 2: ``D(p1, stopgrad(z2)) / 2 + D(p2, stopgrad(z1)) / 2`` (``losses/simsiam.py``)."""

    def __init__(self, simsiam_cfg, model_cfg=None):
        super().__init__()

    def forward(self, model_output, num_crops: int, teacher_output=None) -> torch.Tensor:
        if num_crops != 2:
            raise ValueError(f"simsiam_loss needs exactly 2 crops per image, got {num_crops}")
        if not isinstance(model_output, (tuple, list)) or len(model_output) != 2:
            raise ValueError("simsiam_loss expects (projections, predictions) from a simsiam head")
        projections, predictions = model_output
        return symmetric_simsiam_loss(predictions.chunk(2), projections.chunk(2))


HEAD = Head("simsiam", build_head, head_keys)

METHOD = Method(
    name="simsiam_loss",
    criterion=SimSiamCriterion,
    head=HEAD,
    section=section,
    max_crops=2,
)
