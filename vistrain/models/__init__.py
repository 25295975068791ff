"""Models: ``build_ssl_model(cfg.MODEL, build_head)`` -> SSLModel (trunk from ``TRUNKS``, then the
head ``build_head`` makes of ``MODEL.HEAD``). The heads' registry belongs to the methods
(``vistrain.methods.HEADS``), whose ``build_model(cfg.MODEL)`` passes the right builder."""

from typing import Callable

from torch import nn

from vistrain.config.errors import ConfigError
from vistrain.models.ssl_model import SSLModel
from vistrain.models.trunks import TRUNKS, build_trunk


def build_ssl_model(model_cfg, build_head: Callable[..., nn.Module]) -> SSLModel:
    """Plain (unsharded, undistributed) model for ``cfg.MODEL``: its TRUNK, then
    ``build_head(MODEL.HEAD, trunk)`` (a head sized by its trunk, MAE's decoder, reads it). ConfigError (one line) for a head whose input does not fit the trunk."""
    trunk = build_trunk(model_cfg.TRUNK)
    head = build_head(model_cfg.HEAD, trunk)
    in_feature = getattr(head, "in_feature", None)
    if in_feature is not None:
        width = trunk.feature_dims[in_feature]
        if model_cfg.HEAD.DIMS[0] != width:
            raise ConfigError(
                f"MODEL.HEAD.DIMS[0] is {model_cfg.HEAD.DIMS[0]} but the trunk's {in_feature!r} "
                f"feature has {width} channels; set MODEL.HEAD.DIMS[0]={width}"
            )
    return SSLModel(trunk, head)


__all__ = ["TRUNKS", "SSLModel", "build_ssl_model"]
