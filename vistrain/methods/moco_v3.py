"""MoCo v3 (Chen, Xie and He, 2021): the student's prediction of one view against the momentum
teacher's projections of the other view of every image of the global batch, InfoNCE with a
temperature, symmetrised (``vistrain/losses/moco.py``); head "moco_v3": a projector and a
predictor MLP as the authors' ``moco/builder.py`` builds them (``MoCo_ResNet``, ``MoCo_ViT``).
Exactly two crops per image; on a ViT the paper's frozen random patch projection is
``MODEL.TRUNK.VIT.FROZEN_PATCH_PROJECTION`` and the authors' head reads the class token
(``MODEL.HEAD.INPUT_FEATURE: cls``; the default reads the mean patch token)."""

from typing import List, Sequence, Tuple

import torch
from fvcore.common.config import CfgNode
from torch import nn

from vistrain.config.checks import above, probability
from vistrain.config.errors import ConfigError
from vistrain.losses.moco import symmetric_moco_v3_loss
from vistrain.methods.base import Criterion, Head, LossCollective, Method
from vistrain.models.heads.mlp import MLP


def section() -> CfgNode:
    """LOSS.moco_v3_loss."""
    c = CfgNode()
    # tau of the InfoNCE logits q . k / tau; the authors' code: 1.0 for ResNet-50 (its default),
    # 0.2 for ViTs (--moco-t=.2)
    c.temperature = 1.0
    c.momentum_teacher = 0.99  # m0: cosine from m0 to 1 over the run (the authors' --moco-m-cos)
    return c


def head_keys() -> CfgNode:
    """MODEL.HEAD keys of the moco_v3 head (the byol head reads the same key)."""
    c = CfgNode()
    c.PREDICTOR_DIMS = [128, 512, 128]  # byol, moco_v3: predictor MLP dims (first = DIMS[-1])
    return c


class MoCoV3Head(nn.Module):
    """``forward(x)``: x (N, dims[0]) -> (projection k (N, D), prediction q (N, D)).

    MoCo v3: "the projection head is [an] MLP ... and the prediction head is a 2-layer MLP ...
    The hidden layers of both MLPs are 4096-d and are with ReLU; the output layers of both MLPs
    are 256-d, without ReLU. ... all layers in both MLPs have BN" (the output layers' BN without
    affine parameters, as the authors' ``_build_mlp``). The authors' projector has 2 layers on a
    ResNet ([2048, 4096, 256]) and 3 on a ViT; the predictor [256, 4096, 256]. Their code departs
    from that sentence on a ResNet: its predictor's last layer has no BatchNorm
    (``MoCo_ResNet``: ``_build_mlp(2, dim, mlp_dim, dim, False)``), and neither has its bias.
    ``token_trunk``: the trunk is a ViT (it has a token sequence), which keeps the predictor's
    last BN; on any other trunk the predictor ends in a plain Linear without bias, as the
    authors' ResNet. The other Linear layers keep a bias (the authors' have none), which the
    BatchNorm after each cancels. The momentum teacher is built by the same builder (so it holds
    a predictor too, averaged but unused): the loss reads the student's predictions and the
    teacher's projections.
    """

    in_feature = "avgpool"

    def __init__(
        self, dims: Sequence[int], predictor_dims: Sequence[int], use_bn: bool, token_trunk: bool = True
    ):
        super().__init__()
        self.projection = MLP(dims, use_bn, last_bn=True)
        if int(predictor_dims[0]) != self.projection.dims[-1]:
            raise ConfigError(
                f"MODEL.HEAD.PREDICTOR_DIMS[0] must equal MODEL.HEAD.DIMS[-1] ({self.projection.dims[-1]}), "
                f"got {predictor_dims[0]}"
            )
        self.predictor = MLP(predictor_dims, use_bn, last_bn=token_trunk, bias=token_trunk)

    def forward(self, x: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        k = self.projection(x)
        return k, self.predictor(k)


def build_head(head_cfg, trunk: nn.Module) -> MoCoV3Head:
    """The head for ``trunk``: a ViT's (a trunk with a token sequence) or a ResNet's."""
    token_trunk = "sequence" in trunk.feature_dims
    return MoCoV3Head(head_cfg.DIMS, head_cfg.PREDICTOR_DIMS, head_cfg.USE_BN, token_trunk)


class MoCoV3Criterion(Criterion):
    """MoCo v3 on the student's ``(projections (2N, D), predictions (2N, D))`` and the teacher's
    of the same two views: ``ctr(q1, k2) + ctr(q2, k1)`` (``losses/moco.py``), each key set the
    teacher's projections of all ranks' images (all-gathered, without gradient: targets)."""

    def __init__(self, moco_cfg, model_cfg=None):
        super().__init__()
        self.temperature = float(moco_cfg.temperature)
        self.teacher_momentum = float(moco_cfg.momentum_teacher)

    def forward(self, model_output, num_crops: int, teacher_output=None) -> torch.Tensor:
        if num_crops != 2:
            raise ValueError(f"moco_v3_loss needs exactly 2 crops per image, got {num_crops}")
        if teacher_output is None:
            raise ValueError("moco_v3_loss needs the teacher's output")
        _, queries = model_output
        keys, _ = teacher_output
        return symmetric_moco_v3_loss(queries.chunk(2), keys.chunk(2), self.temperature)


def collectives(cfg: CfgNode, world: int) -> List[LossCollective]:
    """The all-gather of the teacher's projections of each view, (B, D) in fp32, once per term."""
    keys = world * cfg.DATA.TRAIN.BATCHSIZE_PER_REPLICA * cfg.MODEL.HEAD.DIMS[-1] * 4
    return [LossCollective("all_gather", keys, 2)]


HEAD = Head("moco_v3", build_head, head_keys, sized_by_trunk=True)

METHOD = Method(
    name="moco_v3_loss",
    criterion=MoCoV3Criterion,
    head=HEAD,
    section=section,
    rules={"temperature": [above(0)], "momentum_teacher": [probability]},
    teacher=True,
    max_crops=2,
    collectives=collectives,
)
