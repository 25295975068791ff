"""VICReg (Bardes, Ponce and LeCun, 2022): invariance (the mean squared distance of the two views'
embeddings), variance (a hinge on each dimension's standard deviation) and covariance (the
off-diagonal covariances squared), all over the global batch (``vistrain/losses/vicreg.py``);
head "vicreg": the expander MLP. No teacher, exactly two crops per image."""

import torch
from fvcore.common.config import CfgNode

from vistrain.config.checks import at_least
from vistrain.losses.vicreg import vicreg_loss
from vistrain.methods.base import (
    Criterion,
    Head,
    Method,
    gathered_view_collectives,
    square_matrices_memory,
    two_views,
)
from vistrain.models.heads.mlp import MLP

# the loss's peak over the model's activations, in (D, D) fp32 matrices (each view's covariance,
# its off-diagonal copy and square, their gradients): 5.2 where glibc maps and unmaps each
# (D = 4096), 13-16 below its 32 MiB mmap limit (python dev/bench/bench_loss_memory.py)
PEAK_MATRICES = 6


def section() -> CfgNode:
    """LOSS.vicreg_loss."""
    c = CfgNode()
    c.invariance_weight = 25.0  # lambda of the invariance term s(Z, Z') (the paper's 25)
    c.variance_weight = 25.0  # mu of the variance term (v(Z) + v(Z')) / 2 (the paper's 25)
    c.covariance_weight = 1.0  # nu of the covariance term c(Z) + c(Z') (the paper's 1)
    return c


def build_head(head_cfg) -> MLP:
    """VICReg's expander: "two fully-connected layers with batch normalization and ReLU, and a
    third linear layer" (``DIMS`` = [input, 8192, 8192, 8192] in the paper)."""
    return MLP(head_cfg.DIMS, head_cfg.USE_BN)


class VICRegCriterion(Criterion):
    """VICReg on the expander's (2N, D) output, rows [0, N) view 1 and [N, 2N) view 2:
    ``lambda s(Z, Z') + mu (v(Z) + v(Z')) / 2 + nu (c(Z) + c(Z'))`` over the global batch
    (lightly's ``gather_distributed=True``), gamma 1 and eps 1e-4 as the paper's."""

    def __init__(self, vicreg_cfg, model_cfg=None):
        super().__init__()
        self.weights = (
            float(vicreg_cfg.invariance_weight),
            float(vicreg_cfg.variance_weight),
            float(vicreg_cfg.covariance_weight),
        )

    def forward(self, model_output, num_crops: int, teacher_output=None) -> torch.Tensor:
        z_a, z_b = two_views(model_output, num_crops, "vicreg_loss")
        return vicreg_loss(z_a, z_b, *self.weights)


HEAD = Head("vicreg", build_head)

METHOD = Method(
    name="vicreg_loss",
    criterion=VICRegCriterion,
    head=HEAD,
    section=section,
    rules={key: [at_least(0)] for key in ("invariance_weight", "variance_weight", "covariance_weight")},
    max_crops=2,
    collectives=gathered_view_collectives,
    loss_memory=square_matrices_memory(PEAK_MATRICES),
)
