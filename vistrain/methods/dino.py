"""DINO (Caron et al., 2021): self-distillation with a momentum teacher that sees the global crops
only, its output centred and sharpened (``vistrain/losses/dino.py``); head "dino": an MLP, L2
normalisation and a weight-normalised last layer kept in fp32 and frozen in the first epochs."""

from typing import List, Sequence

import torch
import torch.nn.functional as F
from fvcore.common.config import CfgNode
from torch import nn

from vistrain.config.errors import ConfigError
from vistrain.config.warmups import Warmup
from vistrain.fsdp import params_of
from vistrain.losses.dino import DINOLoss, teacher_temperature
from vistrain.methods.base import Criterion, Head, LossCollective, Method, global_crops_fit, modules_of
from vistrain.models.heads.mlp import MLP


def section() -> CfgNode:
    """LOSS.dino_loss."""
    c = CfgNode()
    c.num_global_crops = 2  # the first crops: the teacher sees only these
    c.student_temp = 0.1
    c.teacher_temp = 0.04  # after the warm-up
    c.warmup_teacher_temp = 0.04  # linear from this over the warm-up epochs
    c.warmup_teacher_temp_epochs = 0
    c.center_momentum = 0.9  # the centre's EMA over the global batch's teacher outputs
    c.freeze_last_layer_epochs = 1  # the head's last layer gets no update this long
    c.momentum_teacher = 0.996  # m0: cosine from m0 to 1 over the run
    return c


def head_keys() -> CfgNode:
    """MODEL.HEAD keys of the dino head."""
    c = CfgNode()
    c.OUT_DIM = 1024  # dino: width K of the weight-normalised last layer (DINO: 65536)
    c.NORM_LAST_LAYER = True  # dino: the last layer's row norms fixed at 1 (False: learnt)
    return c


# ---------------------------------------------------------------------------------------- head


class DINOLastLayer(nn.Linear):
    """DINO's weight-normalised last layer: ``logits = z W^T`` with ``W = g * V / ||V||`` row by
    row, (N, B) -> (N, K) in float32, no bias.

    DINO: "a weight normalized fully connected layer with K dimensions" (``nn.utils.weight_norm``,
    ``weight_g`` filled with 1). ``norm_last_layer`` (DINO's default) keeps g at 1: no ``weight_g``
    parameter at all; else ``weight_g`` (K, 1) starts at 1 and is learnt. Computed here directly (no
    forward hooks, so the sharded engine's views stay the only weights); ``weight`` is V. Its own
    class: a wrap policy keeps it a separate full-precision unit, which the first epoch freezes.
    """

    def __init__(self, dim: int, out_dim: int, norm_last_layer: bool = True):
        super().__init__(dim, out_dim, bias=False)
        self.weight_g = None if norm_last_layer else nn.Parameter(torch.ones(out_dim, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = torch.promote_types(x.dtype, torch.float32)
        with torch.autocast(device_type="cpu" if x.is_meta else x.device.type, enabled=False):
            weight = F.normalize(self.weight.to(dtype), dim=1, p=2)
            if self.weight_g is not None:
                weight = weight * self.weight_g.to(dtype)
            return F.linear(x.to(dtype), weight)


class DINOHead(nn.Module):
    """``forward(x)``: x (N, dims[0]) -> logits (N, out_dim), float32.

    DINO: "a 3-layer multi-layer perceptron (MLP) with hidden dimension 2048 followed by l2
    normalization and a weight normalized fully connected layer with K dimensions"; GELU between
    the MLP layers, ``dims`` = [input, hidden..., bottleneck] (DINO: [*, 2048, 2048, 256]).
    """

    in_feature = "avgpool"

    def __init__(self, dims: Sequence[int], use_bn: bool, out_dim: int, norm_last_layer: bool = True):
        super().__init__()
        if out_dim <= 0:
            raise ConfigError(f"MODEL.HEAD.OUT_DIM must be positive, got {out_dim}")
        self.projection = MLP(dims, use_bn, activation="gelu")
        self.last_layer = DINOLastLayer(self.projection.dims[-1], out_dim, norm_last_layer)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.last_layer(F.normalize(self.projection(x), dim=-1, p=2))


def build_head(head_cfg) -> DINOHead:
    return DINOHead(head_cfg.DIMS, head_cfg.USE_BN, head_cfg.OUT_DIM, head_cfg.NORM_LAST_LAYER)


# ----------------------------------------------------------------------------------- criterion


class DINOCriterion(Criterion):
    """DINO on logits (C*N, K): rows [c*N, (c+1)*N) are crop c, the ``num_global_crops`` first
    crops are the global ones; the teacher sees only those, (G*N, K).

    Per-step state: the centre (``loss.center``, equal on every rank: all-reduced), the teacher
    temperature (warm-up by epoch), the last layer frozen during the first
    ``freeze_last_layer_epochs`` epochs (DINO's ``cancel_gradients_last_layer``).
    """

    def __init__(self, dino_cfg, model_cfg=None):
        super().__init__()
        if model_cfg is None:
            raise ValueError("dino_loss needs MODEL (build it with build_method(cfg))")
        self.cfg = dino_cfg
        self.num_global_crops = int(dino_cfg.num_global_crops)
        self.teacher_momentum = float(dino_cfg.momentum_teacher)
        self.loss = DINOLoss(int(model_cfg.HEAD.OUT_DIM), dino_cfg.student_temp, dino_cfg.center_momentum)
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
        return [param for module in modules_of(model, DINOLastLayer, "dino") for param in params_of(module)]

    def load_shared_state(self, state: dict) -> None:
        self.loss.center.copy_(state["loss.center"])


def collectives(cfg: CfgNode, world: int) -> List[LossCollective]:
    """The centre's all-reduce of the teacher outputs' sum, (1, K) in fp32."""
    return [LossCollective("all_reduce", cfg.MODEL.HEAD.OUT_DIM * 4, 1)]


HEAD = Head("dino", build_head, head_keys, fp32_units=(DINOLastLayer,))  # frozen first: its own shards

METHOD = Method(
    name="dino_loss",
    criterion=DINOCriterion,
    head=HEAD,
    section=section,
    checks=(global_crops_fit,),
    teacher=True,
    collectives=collectives,
    # linspace(warmup, final, W)[epoch]: the final temperature from epoch W - 1 on
    warmups=(Warmup("warmup_teacher_temp_epochs", "epochs", 1), Warmup("freeze_last_layer_epochs", "epochs")),
)
