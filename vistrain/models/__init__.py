"""Models: ``build_model(cfg.MODEL)`` -> SSLModel (trunk from ``TRUNKS``, head from ``HEADS``)."""

import torch

from vistrain.config.errors import ConfigError
from vistrain.models.heads import HEADS, SwAVHead, SwAVPrototypes, build_head
from vistrain.models.ssl_model import SSLModel
from vistrain.models.trunks import TRUNKS, build_trunk


def build_model(model_cfg) -> SSLModel:
    """Plain (unsharded, undistributed) model for ``cfg.MODEL``; reads its TRUNK and HEAD.
    ConfigError (one line) for a head whose input does not fit the trunk."""
    trunk = build_trunk(model_cfg.TRUNK)
    head = build_head(model_cfg.HEAD)
    in_feature = getattr(head, "in_feature", None)
    if in_feature is not None:
        width = trunk.feature_dims[in_feature]
        if model_cfg.HEAD.DIMS[0] != width:
            raise ConfigError(
                f"MODEL.HEAD.DIMS[0] is {model_cfg.HEAD.DIMS[0]} but the trunk's {in_feature!r} "
                f"feature has {width} channels; set MODEL.HEAD.DIMS[0]={width}"
            )
    return SSLModel(trunk, head)


def build_meta_model(model_cfg) -> SSLModel:
    """:func:`build_model` on the meta device: shapes and widths without memory or initialisation
    (the config check, the memory planner)."""
    with torch.device("meta"):
        return build_model(model_cfg)


__all__ = [
    "HEADS",
    "TRUNKS",
    "SSLModel",
    "SwAVHead",
    "SwAVPrototypes",
    "build_meta_model",
    "build_model",
]
