"""Heads the models layer keeps: the generic projection ``MLP`` (methods build their heads from it)
and the "identity" head of the benchmarks. A method's own head lives in its method file
(``vistrain/methods/``), whose registry ``HEADS`` maps ``MODEL.HEAD.NAME`` to builders.

A head declares ``in_feature``: the trunk output it consumes (``"avgpool"``), or ``None`` to
receive the trunk's whole feature dict (the benchmarks' "identity").
"""

from typing import Dict

import torch
from torch import nn

from vistrain.models.heads.mlp import MLP


class IdentityHead(nn.Module):
    """Returns the trunk's feature dict unchanged (feature extraction, linear eval, kNN)."""

    in_feature = None

    def forward(self, features: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
        return features


def build_identity_head(head_cfg) -> IdentityHead:
    return IdentityHead()


__all__ = ["IdentityHead", "MLP", "build_identity_head"]
