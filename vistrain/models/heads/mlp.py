"""Projection MLP (SimCLR's g(.), also the first part of the SwAV, DINO and BYOL heads)."""

from typing import List, Sequence

import torch
from torch import nn

from vistrain.config.errors import ConfigError


class MLP(nn.Module):
    """``Linear -> [BatchNorm1d] -> ReLU`` (or GELU) for every hidden layer, then a plain ``Linear``.

    SimCLR (Chen et al., 2020): "a MLP with one hidden layer to obtain z_i = g(h_i) =
    W2 relu(W1 h_i)"; BatchNorm after the hidden Linear follows SimCLR v2 / SwAV; DINO's head
    uses GELU. ``last_bn`` (with ``use_bn``): a BatchNorm1d without affine parameters after the
    last Linear too, as MoCo v3's projector (and its predictor on a ViT). ``bias``: the Linear
    layers' biases (MoCo v3's and Barlow Twins' have none; before a BatchNorm a bias changes nothing).
    ``forward(x)``: x (N, dims[0]) -> (N, dims[-1]) in the input's dtype (or autocast's).
    Reads the trunk's ``"avgpool"`` feature (``in_feature``).
    """

    in_feature = "avgpool"

    def __init__(
        self,
        dims: Sequence[int],
        use_bn: bool = True,
        activation: str = "relu",
        last_bn: bool = False,
        bias: bool = True,
    ):
        super().__init__()
        dims = _check_dims(dims)
        layers: List[nn.Module] = []
        for d_in, d_out in zip(dims[:-2], dims[1:-1]):
            layers.append(nn.Linear(d_in, d_out, bias=bias))
            if use_bn:
                layers.append(nn.BatchNorm1d(d_out))
            layers.append(nn.GELU() if activation == "gelu" else nn.ReLU(inplace=True))
        layers.append(nn.Linear(dims[-2], dims[-1], bias=bias))
        if use_bn and last_bn:
            layers.append(nn.BatchNorm1d(dims[-1], affine=False))
        self.layers = nn.Sequential(*layers)
        self.dims = dims

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)


def _check_dims(dims: Sequence[int]) -> List[int]:
    dims = [int(d) for d in dims]
    if len(dims) < 2 or min(dims) <= 0:
        raise ConfigError(f"MODEL.HEAD.DIMS needs at least two positive sizes (input, output), got {dims}")
    return dims
