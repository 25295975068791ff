"""DINO and BYOL heads (Caron et al., 2021; Grill et al., 2020): plain modules, no teacher logic."""

from typing import Sequence, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from vistrain.models.heads.mlp import MLP


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
            raise ValueError(f"MODEL.HEAD.OUT_DIM must be positive, got {out_dim}")
        self.projection = MLP(dims, use_bn, activation="gelu")
        self.last_layer = DINOLastLayer(self.projection.dims[-1], out_dim, norm_last_layer)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.last_layer(F.normalize(self.projection(x), dim=-1, p=2))


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
            raise ValueError(
                f"MODEL.HEAD.PREDICTOR_DIMS[0] must equal MODEL.HEAD.DIMS[-1] ({self.projection.dims[-1]}), "
                f"got {predictor_dims[0]}"
            )
        self.predictor = MLP(predictor_dims, use_bn)

    def forward(self, x: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        z = self.projection(x)
        return z, self.predictor(z)


def build_dino_head(head_cfg) -> DINOHead:
    return DINOHead(head_cfg.DIMS, head_cfg.USE_BN, head_cfg.OUT_DIM, head_cfg.NORM_LAST_LAYER)


def build_byol_head(head_cfg) -> BYOLHead:
    return BYOLHead(head_cfg.DIMS, head_cfg.PREDICTOR_DIMS, head_cfg.USE_BN)
