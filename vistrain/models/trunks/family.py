"""What a trunk family file declares (:class:`TrunkFamily`), so nothing outside it knows the family.

The registry ``vistrain.models.trunks.TRUNKS`` maps ``MODEL.TRUNK.NAME`` to one of these. The
sharding transform and the planner read ``units`` / ``checkpointed`` (module classes, merged over
all families: each class occurs only in its own family's models), the config check reads
``feature_names`` and ``names``, the exports (``vistrain/checkpoint/export.py``) call
``to_torchvision`` / ``to_timm`` (renaming keys only: the values pass through untouched, so an
export streams one tensor at a time) and write ``load_line`` into the model card; without the
run's config they pick the family by ``torchvision_prefixes``.
"""

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Mapping, Optional, Sequence, Tuple, Type, Union

from torch import nn


@dataclass(frozen=True)
class TokenLayout:
    """What a masked-image method needs of a trunk (MAE's decoder, iBOT's masks): a ViT of square
    ``patch_size`` patches, with or without a class token, with or without a learned mask token."""

    patch_size: int
    class_token: bool
    mask_token: bool


@dataclass(frozen=True)
class TrunkFamily:
    # MODEL.TRUNK -> nn.Module with forward(x) -> Dict[str, Tensor], ``feature_dims`` (every
    # feature name -> channels), ``out_features`` (the requested ones), optionally
    # ``vector_features`` (the (N, C) features, which benchmarks do not pool; default: avgpool), and
    # for fine-tuning's layer-wise lr decay ``num_lr_layers`` L and ``lr_layer_of(name) -> 0..L``
    build: Callable[..., nn.Module]
    # MODEL.TRUNK -> every feature name the trunk offers; pure arithmetic, ValueError (one line)
    # for an impossible configuration
    feature_names: Callable[..., List[str]]
    # MODEL.FSDP_CONFIG.wrap_granularity ("block", "stage") -> classes that are sharded units
    units: Mapping[str, Tuple[Type[nn.Module], ...]]
    # MODEL.ACTIVATION_CHECKPOINTING.GRANULARITY ("block", "stage") -> classes recomputed in backward
    checkpointed: Mapping[str, Tuple[Type[nn.Module], ...]]
    # first components of the trunk's state-dict keys, which are torchvision's names
    torchvision_prefixes: Tuple[str, ...]
    # (trunk state dict, prefix) -> the torchvision model's state dict (ValueError if it has none)
    to_torchvision: Callable[[Dict, str], Dict]
    # config-check catalog key -> valid names (e.g. {"resnets": [...]} for MODEL.TRUNK.RESNET.NAME)
    names: Mapping[str, Sequence[str]] = field(default_factory=dict)
    # (trunk state dict, prefix) -> the state dict ``timm.create_model(name, num_classes=0)``
    # loads (None: the family's trunks are not timm models)
    to_timm: Optional[Callable[[Dict, str], Dict]] = None
    # (MODEL.TRUNK, library, path) -> the Python line that builds the trunk in ``library``
    # ("timm" or "torchvision") and loads the exported file ``path`` (a torch or .safetensors file):
    # an expression, or statements binding ``model``; the model card adds the imports of the
    # libraries it names (and ``model = `` before an expression). ValueError (one line) for a
    # trunk ``library`` has no model of (None: no such line)
    load_line: Optional[Callable[..., str]] = None
    # MODEL.TRUNK -> its TokenLayout, or one line saying why masked-image methods cannot mask it
    # (None: the family has no token models)
    tokens: Optional[Callable[..., Union[TokenLayout, str]]] = None
    # whether ``build`` honours MODEL.TRUNK.IN_CHANNELS itself; else the registry replaces the first
    # convolution of the built trunk by one of IN_CHANNELS inputs (torch's default initialisation)
    builds_in_channels: bool = False


def check_out_features(out_features: Sequence[str], valid: List[str]) -> List[str]:
    """``out_features`` as a list; ValueError unless it is a non-empty subset of ``valid``."""
    out_features = list(out_features)
    unknown = [name for name in out_features if name not in valid]
    if not out_features or unknown:
        raise ValueError(
            f"MODEL.TRUNK.OUT_FEATURES must be a non-empty subset of {valid}, got {out_features}"
        )
    return out_features


def unknown_name(key: str, name: str, valid: Sequence[str]) -> ValueError:
    return ValueError(f"unknown {key} {name!r}; valid names: {', '.join(valid)}")


def torchvision_keys(state_dict: Dict, prefix: str, prefixes: Sequence[str], family: str) -> "OrderedDict":
    """``state_dict`` without ``prefix`` (keys not starting with it are dropped); ValueError unless
    every remaining key's first component is one of ``prefixes`` (a ``family`` trunk's)."""
    out = OrderedDict()
    for key, value in state_dict.items():
        if not key.startswith(prefix):
            continue
        name = key[len(prefix) :]
        if name.split(".")[0] not in prefixes:
            raise ValueError(f"state dict key {key!r} is not a {family} trunk parameter or buffer")
        out[name] = value
    if not out:
        raise ValueError(f"no {family} trunk keys found (prefix {prefix!r})")
    return out


def torchvision_load_line(build: str, classifier: str, path: str) -> str:
    """Statements that build a torchvision model (``build``, an expression), replace its
    classifier attribute ``classifier`` by ``nn.Identity`` and load the torch or ``.safetensors``
    file ``path`` strictly: ``model(x)`` is then the trunk's pooled feature."""
    if path.endswith(".safetensors"):
        state = f"safetensors.torch.load_file({path!r})"
    else:
        state = f"torch.load({path!r}, weights_only=True)"
    return "\n".join(
        [
            f"model = {build}",
            f"model.{classifier} = torch.nn.Identity()  # model(x): the trunk's pooled feature",
            f"model.load_state_dict({state})",
        ]
    )
