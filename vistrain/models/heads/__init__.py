"""Heads: ``build_head(cfg.MODEL.HEAD)`` picks a builder from the flat ``HEADS`` registry.

A head declares ``in_feature``: the trunk output it consumes (``"avgpool"``), or ``None`` to
receive the trunk's whole feature dict (the benchmarks' "identity").
"""

from typing import Dict

import torch
from torch import nn

from vistrain.models.heads.dino import BYOLHead, DINOHead, DINOLastLayer, build_byol_head, build_dino_head
from vistrain.models.heads.mlp import MLP, build_simclr_head
from vistrain.models.heads.swav import SwAVHead, SwAVPrototypes, build_swav_head


class IdentityHead(nn.Module):
    """Returns the trunk's feature dict unchanged (feature extraction, linear eval, kNN)."""

    in_feature = None

    def forward(self, features: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
        return features


def build_identity_head(head_cfg) -> IdentityHead:
    return IdentityHead()


HEADS = {
    "simclr": build_simclr_head,
    "swav": build_swav_head,
    "dino": build_dino_head,
    "byol": build_byol_head,
    "identity": build_identity_head,
}


def build_head(head_cfg) -> nn.Module:
    if head_cfg.NAME not in HEADS:
        raise ValueError(f"unknown MODEL.HEAD.NAME {head_cfg.NAME!r}; valid names: {sorted(HEADS)}")
    return HEADS[head_cfg.NAME](head_cfg)


__all__ = [
    "BYOLHead",
    "DINOHead",
    "DINOLastLayer",
    "HEADS",
    "IdentityHead",
    "MLP",
    "SwAVHead",
    "SwAVPrototypes",
    "build_head",
]
