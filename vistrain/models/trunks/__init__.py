"""Trunks: ``build_trunk(cfg.MODEL.TRUNK)`` picks a family from the flat ``TRUNKS`` registry.

Each family is one file (``regnet``, ``resnet``, ``vit``; ``timm_models`` and ``torchvision_models``
adopt those libraries' models) declaring a :class:`TrunkFamily`: its
builder, feature names, sharded-unit and checkpoint classes and torchvision key prefixes. Code
outside the family files asks this registry, never a family by name.
"""

from typing import Dict, List, Union

from torch import nn

from vistrain.models.trunks.family import TokenLayout, TrunkFamily, torchvision_keys
from vistrain.models.trunks.regnet import REGNET, RegNetTrunk
from vistrain.models.trunks.resnet import RESNET, ResNetTrunk
from vistrain.models.trunks.timm_models import TIMM
from vistrain.models.trunks.torchvision_models import TORCHVISION, set_input_channels
from vistrain.models.trunks.vit import VIT, ViTTrunk

# MODEL.TRUNK.NAME -> family; a family's builder(trunk_cfg) returns an nn.Module with
# forward(x) -> Dict[str, Tensor], feature_dims, out_features
TRUNKS: Dict[str, TrunkFamily] = {
    "regnet": REGNET,
    "resnet": RESNET,
    "vit": VIT,
    "timm": TIMM,
    "torchvision": TORCHVISION,
}


def family(trunk_cfg) -> TrunkFamily:
    """The family of ``cfg.MODEL.TRUNK``; ValueError listing the valid names."""
    if trunk_cfg.NAME not in TRUNKS:
        raise ValueError(f"unknown MODEL.TRUNK.NAME {trunk_cfg.NAME!r}; valid names: {sorted(TRUNKS)}")
    return TRUNKS[trunk_cfg.NAME]


def build_trunk(trunk_cfg) -> nn.Module:
    """The trunk of ``cfg.MODEL.TRUNK``, taking images of ``IN_CHANNELS`` channels."""
    fam = family(trunk_cfg)
    trunk = fam.build(trunk_cfg)
    if trunk_cfg.IN_CHANNELS != 3 and not fam.builds_in_channels:
        set_input_channels(trunk, trunk_cfg.IN_CHANNELS)
    return trunk


def token_layout(trunk_cfg) -> Union[TokenLayout, str]:
    """The trunk's :class:`TokenLayout` for masked-image methods, or one line saying why it has
    none (nothing is built for the built-in ViT; a timm model is built on the meta device)."""
    fam = family(trunk_cfg)
    if fam.tokens is None:
        return f"MODEL.TRUNK.NAME={trunk_cfg.NAME} has no patch tokens to mask: use a ViT (vit, or a timm VisionTransformer)"
    return fam.tokens(trunk_cfg)


def trunk_feature_names(trunk_cfg) -> List[str]:
    """Every feature the trunk of ``trunk_cfg`` offers (nothing is built); ValueError (one line)
    for an impossible trunk."""
    return family(trunk_cfg).feature_names(trunk_cfg)


def to_torchvision_state_dict(trunk_state_dict: Dict, prefix: str = "") -> Dict:
    """Trunk state dict (keys after ``prefix``, e.g. ``"trunk."``) -> the torchvision model's state
    dict without classifier, for the family whose key prefixes the first trunk key has. Trunk keys
    are already torchvision's: this strips ``prefix`` and checks that every key is a trunk key."""
    first = next((k[len(prefix) :] for k in trunk_state_dict if k.startswith(prefix)), "")
    for fam in TRUNKS.values():
        if first.split(".")[0] in fam.torchvision_prefixes:
            return fam.to_torchvision(trunk_state_dict, prefix)
    return torchvision_keys(trunk_state_dict, prefix, (), "known")


__all__ = [
    "TRUNKS",
    "RegNetTrunk",
    "TokenLayout",
    "ResNetTrunk",
    "TrunkFamily",
    "ViTTrunk",
    "build_trunk",
    "family",
    "to_torchvision_state_dict",
    "token_layout",
    "trunk_feature_names",
]
