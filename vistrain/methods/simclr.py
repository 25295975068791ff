"""SimCLR (Chen et al., 2020): NT-Xent over every crop of the global batch (``vistrain/losses/simclr.py``),
with multi-crop, hard or debiased negatives and i-Mix; head "simclr", the projection MLP g(.).
No teacher."""

from typing import List, Sequence

import torch
from fvcore.common.config import CfgNode

from vistrain.config.checks import at_least, below
from vistrain.losses.simclr import SimCLRLoss, mix_crops
from vistrain.methods.base import Criterion, Head, LossCollective, Method, global_crops_fit
from vistrain.models.heads.mlp import MLP


def section() -> CfgNode:
    """LOSS.simclr_loss."""
    c = CfgNode()
    c.temperature = 0.1
    # multi-crop positives: 0: every crop of an image a positive of every other (VISSL's form); G > 0:
    # only the pairs with one of the G first (global) crops, two local crops are not (DINO's form)
    c.num_global_crops = 0
    # the negatives' term (losses/simclr.py): tau+, the share of negatives expected to be of the
    # anchor's class (debiased contrastive loss, Chuang et al. 2020; 0: off), and beta, the weight of
    # hard negatives (Robinson et al. 2021; 0: off)
    c.false_negative_prior = 0.0
    c.hardness = 0.0
    # i-Mix (Lee et al. 2021): alpha of the Beta(alpha, alpha) weights with which crop 0 of two images
    # is mixed, scored with the mixture's virtual labels (3 or more crops; not with the options above);
    # 0: off
    c.mix_alpha = 0.0
    return c


class SimCLRCriterion(Criterion):
    """SimCLR on a (C*N, D) embedding tensor: rows [c*N, (c+1)*N) are crop c (C >= 2; with
    multi-crop every crop of an image is a positive of every other, ``losses/simclr.py``).
    With ``mix_alpha`` > 0 (i-Mix) ``student_crops`` mixes crop 0's images in pairs and the next
    ``forward`` scores that mixture with its virtual labels."""

    def __init__(self, simclr_cfg, model_cfg=None):
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


def mix_fits(cfg: CfgNode):
    """i-Mix mixes crop 0 and keys on the other crops; it is its own form of the loss."""
    simclr = cfg.LOSS.simclr_loss
    if simclr.mix_alpha == 0.0:
        return None
    others = [key for key in ("num_global_crops", "false_negative_prior", "hardness") if simclr[key]]
    if others:
        return (
            f"LOSS.simclr_loss.mix_alpha={simclr.mix_alpha} is not combined with {', '.join(others)}: "
            "set them to 0 or mix_alpha to 0"
        )
    transforms = cfg.DATA.TRAIN.TRANSFORMS
    if transforms.NAME == "multicrop" and sum(transforms.NUM_CROPS) < 3:
        return (
            f"LOSS.simclr_loss.mix_alpha={simclr.mix_alpha} needs 3 or more crops per image (crop 0 mixed, "
            f"the others its keys), but DATA.TRAIN.TRANSFORMS.NUM_CROPS={list(transforms.NUM_CROPS)} makes "
            f"{sum(transforms.NUM_CROPS)}: add crops or set mix_alpha to 0"
        )
    return None


def collectives(cfg: CfgNode, world: int) -> List[LossCollective]:
    """The all-gather of every crop's embeddings and the all-reduce of their gradient."""
    gathered = world * 2 * cfg.DATA.TRAIN.BATCHSIZE_PER_REPLICA * cfg.MODEL.HEAD.DIMS[-1] * 4
    return [LossCollective(op, gathered, 1) for op in ("all_gather", "all_reduce")]


def build_head(head_cfg) -> MLP:
    return MLP(head_cfg.DIMS, head_cfg.USE_BN)


HEAD = Head("simclr", build_head)

METHOD = Method(
    name="simclr_loss",
    criterion=SimCLRCriterion,
    head=HEAD,
    section=section,
    rules={
        "num_global_crops": [at_least(0)],
        "false_negative_prior": [at_least(0), below(1)],
        "hardness": [at_least(0)],
        "mix_alpha": [at_least(0)],
    },
    checks=(global_crops_fit, mix_fits),
    collectives=collectives,
)
