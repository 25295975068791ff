"""Barlow Twins (Zbontar et al., 2021): the cross-correlation matrix of the two views' embeddings,
each standardised over the global batch, pushed towards the identity
(``vistrain/losses/barlow_twins.py``, the authors' ``main.py`` on one rank; on several its gradient
is the global batch's, world_size times theirs unless ``authors_gradient_scale``); head
"barlow_twins": the projector MLP. No teacher, exactly two crops per image."""

import torch
from fvcore.common.config import CfgNode

from vistrain.config.checks import at_least
from vistrain.losses.barlow_twins import barlow_twins_loss
from vistrain.methods.base import (
    Criterion,
    Head,
    Method,
    gathered_view_collectives,
    square_matrices_memory,
    two_views,
)
from vistrain.models.heads.mlp import MLP

# the loss's peak over the model's activations, in (D, D) fp32 matrices (C, its diagonal-free
# copy, their squares and gradients): 4.2 where glibc maps and unmaps each (D = 4096), 8-10
# below its 32 MiB mmap limit (python dev/bench/bench_loss_memory.py)
PEAK_MATRICES = 5


def section() -> CfgNode:
    """LOSS.barlow_twins_loss."""
    c = CfgNode()
    # lambda, the weight of the off-diagonal (redundancy reduction) terms: 5e-3 in the paper, for
    # its 8192-wide projector
    c.off_diagonal_weight = 5e-3
    # the gradient on more than one rank: False, the single-process gradient of the global batch
    # (the loss's own); True, the authors' code's, 1 / world_size of it (their all_reduce of the
    # cross-correlation lies outside autograd): like an lr divided by the ranks
    c.authors_gradient_scale = False
    return c


def build_head(head_cfg) -> MLP:
    """Barlow Twins' projector: "three linear layers, each with 8192 output units. The first two
    layers of the projector are followed by a batch normalization layer and rectified linear
    units" (``DIMS`` = [input, 8192, 8192, 8192] in the paper)."""
    return MLP(head_cfg.DIMS, head_cfg.USE_BN)


class BarlowTwinsCriterion(Criterion):
    """Barlow Twins on the projector's (2N, D) output, rows [0, N) view 1 and [N, 2N) view 2:
    ``sum_i (1 - C_ii)^2 + lambda sum_{i != j} C_ij^2`` with C the (D, D) cross-correlation of the
    views standardised over the global batch (the authors' SyncBatchNorm; not lightly's
    ``gather_distributed``, which standardises per rank); the gradient of the global batch, or the
    authors' 1 / world_size of it (``authors_gradient_scale``)."""

    def __init__(self, barlow_cfg, model_cfg=None):
        super().__init__()
        self.off_diagonal_weight = float(barlow_cfg.off_diagonal_weight)
        self.authors_gradient_scale = bool(barlow_cfg.authors_gradient_scale)

    def forward(self, model_output, num_crops: int, teacher_output=None) -> torch.Tensor:
        z_a, z_b = two_views(model_output, num_crops, "barlow_twins_loss")
        return barlow_twins_loss(z_a, z_b, self.off_diagonal_weight, self.authors_gradient_scale)


HEAD = Head("barlow_twins", build_head)

METHOD = Method(
    name="barlow_twins_loss",
    criterion=BarlowTwinsCriterion,
    head=HEAD,
    section=section,
    rules={"off_diagonal_weight": [at_least(0)]},
    max_crops=2,
    collectives=gathered_view_collectives,
    loss_memory=square_matrices_memory(PEAK_MATRICES),
)
