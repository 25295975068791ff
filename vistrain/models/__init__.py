"""Models: ``build_model(cfg.MODEL)`` -> SSLModel (trunk from ``TRUNKS``, head from ``HEADS``)."""

from vistrain.models.heads import HEADS, SwAVHead, SwAVPrototypes, build_head
from vistrain.models.ssl_model import SSLModel
from vistrain.models.trunks import TRUNKS, build_trunk


def build_model(model_cfg) -> SSLModel:
    """Plain (unsharded, undistributed) model for ``cfg.MODEL``; reads its TRUNK and HEAD."""
    trunk = build_trunk(model_cfg.TRUNK)
    head = build_head(model_cfg.HEAD)
    in_feature = getattr(head, "in_feature", None)
    if in_feature is not None:
        width = trunk.feature_dims[in_feature]
        if model_cfg.HEAD.DIMS[0] != width:
            raise ValueError(
                f"MODEL.HEAD.DIMS[0] is {model_cfg.HEAD.DIMS[0]} but the trunk's {in_feature!r} "
                f"feature has {width} channels; set MODEL.HEAD.DIMS[0]={width}"
            )
    return SSLModel(trunk, head)


__all__ = [
    "HEADS",
    "TRUNKS",
    "SSLModel",
    "SwAVHead",
    "SwAVPrototypes",
    "build_model",
]
