"""LeJEPA (Balestriero and LeCun, 2025): SIGReg, an Epps-Pulley test of random 1-D projections of
the embeddings against a standard Gaussian, plus the prediction term that pulls every view's
embedding towards the mean of the image's global views (``vistrain/losses/lejepa.py``, as
lightly 1.6.0's ``LeJEPALoss``); head "lejepa": the projector whose output both terms read. No
teacher, no stop-gradient; 2 or more crops per image, the first ``num_global_crops`` of them
global, the others local (multi-crop)."""

from typing import List

import torch
from fvcore.common.config import CfgNode

from vistrain.config.checks import above, at_least, probability
from vistrain.losses.lejepa import lejepa_loss
from vistrain.methods.base import Criterion, Head, LossCollective, Method, global_crops_fit
from vistrain.models.heads.mlp import MLP

KNOTS = 17  # the Epps-Pulley integral's points on [0, T_MAX] (the authors' minimal example's and lightly's)
T_MAX = 3.0
# the loss's peak over the model's activations, in (V, N, M, K) fp32 tensors: 5.4-8.6 of them
# (python dev/bench/bench_loss_memory.py; 6.8 at the demo's V = 4, N = 64, M = 1024)
PEAK_TENSORS = 6.5


def section() -> CfgNode:
    """LOSS.lejepa_loss."""
    c = CfgNode()
    # the first crops: the global views, whose mean embedding every view is pulled towards; the
    # others are local views (lightly's example: DINO's 2 global + 6 local crops)
    c.num_global_crops = 2
    c.sigreg_weight = 0.05  # lambda: lambda SIGReg + (1 - lambda) prediction (lightly's 0.05)
    # random directions SIGReg tests per step, new every step: lightly's default 1024; the authors'
    # minimal example (rbalestr-lab/lejepa MINIMAL.md) draws 256
    c.num_slices = 1024
    return c


def build_head(head_cfg) -> MLP:
    """LeJEPA's projector, whose output SIGReg and the prediction term read: an MLP with
    BatchNorm and ReLU between its layers (lightly's ``LeJEPAProjectionHead``: [input, 2048,
    2048, 64]); the probes read the trunk."""
    return MLP(head_cfg.DIMS, head_cfg.USE_BN)


class LeJEPACriterion(Criterion):
    """LeJEPA on the projector's (C*N, D) output, rows [c*N, (c+1)*N) crop c, the first
    ``num_global_crops`` crops global: ``lambda SIGReg + (1 - lambda) pred`` over all C views of
    the global batch. SIGReg's directions come from the iteration and the run's seed
    (:meth:`set_iteration`): the same on every rank without communication, and again after a
    resume; before any ``set_iteration`` call, iteration 0 and seed 0."""

    def __init__(self, lejepa_cfg, model_cfg=None):
        super().__init__()
        self.num_global_crops = int(lejepa_cfg.num_global_crops)
        self.sigreg_weight = float(lejepa_cfg.sigreg_weight)
        self.num_slices = int(lejepa_cfg.num_slices)
        self.iteration, self.seed = 0, 0

    def set_iteration(self, iteration: int, seed: int) -> None:
        self.iteration, self.seed = iteration, seed

    def forward(self, model_output, num_crops: int, teacher_output=None) -> torch.Tensor:
        if num_crops < max(self.num_global_crops, 2):
            raise ValueError(
                f"lejepa_loss needs the {self.num_global_crops} global crops and at least 2 crops, got {num_crops}"
            )
        if not isinstance(model_output, torch.Tensor) or model_output.shape[0] % num_crops:
            raise ValueError(f"lejepa_loss expects a ({num_crops}N, D) embedding tensor from a lejepa head")
        views = model_output.view(num_crops, -1, model_output.shape[-1])  # (C, N, D)
        local = views[self.num_global_crops :] if num_crops > self.num_global_crops else None
        return lejepa_loss(
            views[: self.num_global_crops], local, step=self.iteration, seed=self.seed,
            sigreg_weight=self.sigreg_weight, num_slices=self.num_slices, knots=KNOTS, t_max=T_MAX,
        )  # fmt: skip


def collectives(cfg: CfgNode, world: int) -> List[LossCollective]:
    """One differentiable sum over the ranks of the characteristic-function sums (cos and sin for
    every view, slice and knot) and the prediction term's sum, fp32: an all-gather of every
    rank's sums forward, an all-reduce of their gradient backward."""
    views = sum(cfg.DATA.TRAIN.TRANSFORMS.NUM_CROPS)
    sums = world * (2 * views * cfg.LOSS.lejepa_loss.num_slices * KNOTS + 1) * 4
    return [LossCollective(op, sums, 1) for op in ("all_gather", "all_reduce")]


def loss_memory(cfg: CfgNode) -> int:
    """The (V, N, M, K) arguments t x of the characteristic function, their cos and sin and the
    backward's gradients of them: ``PEAK_TENSORS`` such fp32 tensors at the peak."""
    views = sum(cfg.DATA.TRAIN.TRANSFORMS.NUM_CROPS)
    elements = views * cfg.DATA.TRAIN.BATCHSIZE_PER_REPLICA * cfg.LOSS.lejepa_loss.num_slices * KNOTS
    return int(PEAK_TENSORS * elements * 4)


HEAD = Head("lejepa", build_head)

METHOD = Method(
    name="lejepa_loss",
    criterion=LeJEPACriterion,
    head=HEAD,
    section=section,
    rules={"num_global_crops": [at_least(1)], "sigreg_weight": [probability], "num_slices": [above(0)]},
    checks=(global_crops_fit,),
    collectives=collectives,
    loss_memory=loss_memory,
)
