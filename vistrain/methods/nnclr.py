"""NNCLR (Dwibedi et al., 2021): NT-Xent where each view's positive is the nearest neighbour of the
other view's projection in a support set of past projections (``vistrain/losses/nnclr.py``); head
"nnclr": a projector with BatchNorm in every layer and a predictor. The support set is a global
queue of the gathered projections, the same on every rank (resumes on any world size). No teacher;
exactly two crops per image."""

from typing import List, Sequence, Tuple

import torch
from fvcore.common.config import CfgNode
from torch import nn

from vistrain.config.checks import above, at_least
from vistrain.config.errors import ConfigError
from vistrain.losses.nnclr import SupportSet, nnclr_loss
from vistrain.losses.simclr import SimCLRLoss
from vistrain.methods.base import Criterion, Head, LossCollective, Method
from vistrain.models.heads.mlp import MLP


def section() -> CfgNode:
    """LOSS.nnclr_loss."""
    c = CfgNode()
    c.temperature = 0.1  # tau of NT-Xent (the paper's 0.1)
    c.queue_length = 98304  # rows of the support set, latest projections of the global batch (the paper's)
    return c


def head_keys() -> CfgNode:
    """MODEL.HEAD keys of the nnclr head (the byol, moco_v3 and simsiam heads read the same key)."""
    c = CfgNode()
    c.PREDICTOR_DIMS = [128, 512, 128]  # byol, moco_v3: predictor MLP dims (first = DIMS[-1])
    return c


class NNCLRHead(nn.Module):
    """``forward(x)``: x (N, dims[0]) -> (projection z (N, D), prediction p (N, D)).

    NNCLR: "The projection MLP has 3 fully connected layers of sizes [2048, 2048, d]" and the
    prediction MLP "2 layers of size [4096, d]", BatchNorm after every layer of the projector and
    after the predictor's hidden one, ReLU after the hidden ones (d = 256). The projector's output
    BatchNorm has affine parameters, as lightly's ``NNCLRProjectionHead``.
    """

    in_feature = "avgpool"

    def __init__(self, dims: Sequence[int], predictor_dims: Sequence[int], use_bn: bool):
        super().__init__()
        mlp = MLP(dims, use_bn)
        out = mlp.dims[-1]
        self.projection = nn.Sequential(mlp, nn.BatchNorm1d(out)) if use_bn else mlp
        if int(predictor_dims[0]) != out or int(predictor_dims[-1]) != out:
            raise ConfigError(
                f"MODEL.HEAD.PREDICTOR_DIMS must start and end with MODEL.HEAD.DIMS[-1] ({out}): the "
                f"prediction is contrasted with the projections' neighbours; got {list(predictor_dims)}"
            )
        self.predictor = MLP(predictor_dims, use_bn)

    def forward(self, x: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        z = self.projection(x)
        return z, self.predictor(z)


def build_head(head_cfg) -> NNCLRHead:
    return NNCLRHead(head_cfg.DIMS, head_cfg.PREDICTOR_DIMS, head_cfg.USE_BN)


class NNCLRCriterion(Criterion):
    """NNCLR on ``(projections (2N, D), predictions (2N, D))``, rows [0, N) view 0 and [N, 2N) view
    1: ``(NT-Xent(NN(z0), p1) + NT-Xent(NN(z1), p0)) / 2``, then view 1's projections enqueued
    (``losses/nnclr.py``). The support set (``support``: ``queue_length`` x DIMS[-1] float32, first
    filled with random unit rows drawn from the run's seed) is global and equal on every rank, so
    its state loads whole on any world size."""

    def __init__(self, nnclr_cfg, model_cfg=None):
        super().__init__()
        if model_cfg is None:
            raise ValueError("nnclr_loss needs MODEL for its queue's width (build it with build_method(cfg))")
        self.contrast = SimCLRLoss(float(nnclr_cfg.temperature))
        # torch.initial_seed(): SEED_VALUE on every rank of a run (set before the criterion is built)
        self.support = SupportSet(
            int(nnclr_cfg.queue_length), int(model_cfg.HEAD.DIMS[-1]), torch.initial_seed()
        )

    def forward(self, model_output, num_crops: int, teacher_output=None) -> torch.Tensor:
        if num_crops != 2:
            raise ValueError(f"nnclr_loss needs exactly 2 crops per image, got {num_crops}")
        if not isinstance(model_output, (tuple, list)) or len(model_output) != 2:
            raise ValueError("nnclr_loss expects (projections, predictions) from an nnclr head")
        projections, predictions = model_output
        return nnclr_loss(projections.chunk(2), predictions.chunk(2), self.support, self.contrast)

    def load_shared_state(self, state: dict) -> None:
        """The support set is every rank's alike: rank 0's is the queue of any world size."""
        self.load_state_dict(state)


def collectives(cfg: CfgNode, world: int) -> List[LossCollective]:
    """Each NT-Xent term's all-gather of both views (B, D) and the all-reduce of their gradient,
    and the all-gather of view 1's projections into the support set, fp32."""
    view = world * cfg.DATA.TRAIN.BATCHSIZE_PER_REPLICA * cfg.MODEL.HEAD.DIMS[-1] * 4
    return [
        LossCollective("all_gather", 2 * view, 2),
        LossCollective("all_reduce", 2 * view, 2),
        LossCollective("all_gather", view, 1),
    ]


def loss_memory(cfg: CfgNode) -> int:
    """The support set (queue_length, D) and a lookup's cosine similarities (N, queue_length),
    fp32: NNCLR's support set of 98,304 x 256 holds 96 MiB per rank."""
    length = cfg.LOSS.nnclr_loss.queue_length
    return (cfg.MODEL.HEAD.DIMS[-1] + cfg.DATA.TRAIN.BATCHSIZE_PER_REPLICA) * length * 4


HEAD = Head("nnclr", build_head, head_keys)

METHOD = Method(
    name="nnclr_loss",
    criterion=NNCLRCriterion,
    head=HEAD,
    section=section,
    rules={"temperature": [above(0)], "queue_length": [at_least(1)]},
    max_crops=2,
    collectives=collectives,
    loss_memory=loss_memory,
)
