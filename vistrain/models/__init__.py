"""Models: ``build_ssl_model(cfg.MODEL, build_head)`` -> SSLModel (trunk from ``TRUNKS``, then the
head ``build_head`` makes of ``MODEL.HEAD``). The heads' registry belongs to the methods
(``vistrain.methods.HEADS``), whose ``build_model(cfg.MODEL)`` passes the right builder."""

from typing import Callable, Optional

from torch import nn

from vistrain.config.errors import ConfigError
from vistrain.models.ssl_model import SSLModel
from vistrain.models.trunks import TRUNKS, build_trunk


def build_ssl_model(model_cfg, build_head: Callable[..., nn.Module]) -> SSLModel:
    """Plain (unsharded, undistributed) model for ``cfg.MODEL``: its TRUNK, then
    ``build_head(MODEL.HEAD, trunk)`` (a head sized by its trunk, MAE's decoder, reads it), on the
    trunk feature :func:`head_input` names. ConfigError (one line) for a head whose input does not
    fit the trunk."""
    trunk = build_trunk(model_cfg.TRUNK)
    head = build_head(model_cfg.HEAD, trunk)
    in_feature = head_input(model_cfg.HEAD, head, trunk)
    if in_feature is not None:
        width = trunk.feature_dims[in_feature]
        if model_cfg.HEAD.DIMS[0] != width:
            raise ConfigError(
                f"MODEL.HEAD.DIMS[0] is {model_cfg.HEAD.DIMS[0]} but the trunk's {in_feature!r} "
                f"feature has {width} channels; set MODEL.HEAD.DIMS[0]={width}"
            )
    return SSLModel(trunk, head, in_feature)


def head_input(head_cfg, head: nn.Module, trunk: nn.Module) -> Optional[str]:
    """The trunk feature ``head`` reads: its own ``in_feature`` ("avgpool", "sequence"; None: the
    whole feature dict), or for a head on one vector per image (``in_feature`` "avgpool")
    ``MODEL.HEAD.INPUT_FEATURE`` when set, one of the trunk's (N, C) features (a ViT's "cls").
    ConfigError (one line) for one the head cannot read."""
    own, wanted = getattr(head, "in_feature", None), head_cfg.INPUT_FEATURE
    if own is None or not wanted or wanted == own:
        return own
    vectors = list(getattr(trunk, "vector_features", ("avgpool",)))
    if own != "avgpool":
        raise ConfigError(
            f"MODEL.HEAD.INPUT_FEATURE={wanted}: the {head_cfg.NAME} head reads the trunk's {own!r}; "
            "set MODEL.HEAD.INPUT_FEATURE to '' (empty)"
        )
    if wanted not in vectors:
        raise ConfigError(
            f"MODEL.HEAD.INPUT_FEATURE={wanted} is not one of the trunk's vector features {vectors}"
        )
    return wanted


__all__ = ["TRUNKS", "SSLModel", "build_ssl_model", "head_input"]
