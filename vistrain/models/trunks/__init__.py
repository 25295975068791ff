"""Trunks: ``build_trunk(cfg.MODEL.TRUNK)`` picks a builder from the flat ``TRUNKS`` registry."""

from torch import nn

from vistrain.models.trunks.regnet import RegNetTrunk, build_regnet, to_torchvision_state_dict

# name -> builder(trunk_cfg) -> nn.Module with forward(x) -> Dict[str, Tensor], feature_dims,
# out_features
TRUNKS = {"regnet": build_regnet}


def build_trunk(trunk_cfg) -> nn.Module:
    if trunk_cfg.NAME not in TRUNKS:
        raise ValueError(f"unknown MODEL.TRUNK.NAME {trunk_cfg.NAME!r}; valid names: {sorted(TRUNKS)}")
    return TRUNKS[trunk_cfg.NAME](trunk_cfg)


__all__ = ["TRUNKS", "RegNetTrunk", "build_trunk", "to_torchvision_state_dict"]
