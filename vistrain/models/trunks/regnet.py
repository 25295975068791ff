"""RegNet trunk built from torchvision's RegNet design space (Radosavovic et al., 2020).

A RegNet is fixed by five numbers. Block j (of ``depth``) gets the continuous width
``u_j = w_0 + w_a * j``, which is snapped to the geometric grid ``w_0 * w_m^s_j`` with
``s_j = round(log(u_j / w_0) / log(w_m))`` and quantised to a multiple of 8; consecutive blocks of
equal width form a stage. ``torchvision.models.regnet.BlockParams.from_init_params`` does this
maths; we reuse it and torchvision's ``SimpleStemIN`` / ``AnyStage`` / ``ResBottleneckBlock`` so
that

* parameter names match torchvision (``stem.*``, ``trunk_output.block1..blockK.*``) and a trunk
  state dict loads into ``torchvision.models.regnet_*`` (see :func:`to_torchvision_state_dict`);
* a sharding wrap policy can select "every block and the stem" by class.

The trunk has no classifier; it returns a dict of the requested features.
"""

import math
from collections import OrderedDict
from typing import Dict, List, Optional, Sequence

import torch
import torchvision
from torch import nn
from torchvision.models.regnet import AnyStage, BlockParams, ResBottleneckBlock, SimpleStemIN

from vistrain.models.trunks.family import (
    TrunkFamily,
    check_out_features,
    torchvision_keys,
    torchvision_load_line,
)
from vistrain.torch_compat import regnet_stage_settings

# name -> (depth, w_0, w_a, w_m, group_width, se_ratio). The torchvision sizes copy the arguments
# of torchvision's builders (tests compare them); the SEER sizes come from the SEER papers' configs.
PUBLISHED_REGNETS = {
    "regnet_y_400mf": (16, 48, 27.89, 2.09, 8, 0.25),
    "regnet_y_800mf": (14, 56, 38.84, 2.4, 16, 0.25),
    "regnet_y_1_6gf": (27, 48, 20.71, 2.65, 24, 0.25),
    "regnet_y_3_2gf": (21, 80, 42.63, 2.66, 24, 0.25),
    "regnet_y_8gf": (17, 192, 76.82, 2.19, 56, 0.25),
    "regnet_y_16gf": (18, 200, 106.23, 2.48, 112, 0.25),
    "regnet_y_32gf": (20, 232, 115.89, 2.53, 232, 0.25),
    "regnet_y_128gf": (27, 456, 160.83, 2.52, 264, 0.25),
    "regnet_y_256gf": (27, 640, 230.83, 2.53, 373, 0.25),  # SEER
    "regnet_y_10b": (27, 1744, 620.83, 2.52, 1010, 0.25),  # SEER 10B
    "regnet_x_400mf": (22, 24, 24.48, 2.54, 16, None),
    "regnet_x_800mf": (16, 56, 35.73, 2.28, 16, None),
    "regnet_x_1_6gf": (18, 80, 34.01, 2.25, 24, None),
    "regnet_x_3_2gf": (25, 88, 26.31, 2.25, 48, None),
    "regnet_x_8gf": (23, 80, 49.56, 2.88, 120, None),
    "regnet_x_16gf": (22, 216, 55.59, 2.1, 128, None),
    "regnet_x_32gf": (23, 320, 69.86, 2.0, 168, None),
}
PUBLISHED_STEM_WIDTH = 32  # every published RegNet uses a 32-channel stem
TORCHVISION_PREFIXES = ("stem", "trunk_output")  # first components of the trunk's keys


def feature_names(regnet_cfg) -> List[str]:
    """The features a RegNet of ``regnet_cfg`` offers (MODEL.TRUNK.OUT_FEATURES): stem, s1..sK for
    its K stages, avgpool. Pure arithmetic, nothing is built; ValueError for impossible parameters."""
    stages = len(block_params_from_config(regnet_cfg).widths)
    return ["stem", *(f"s{i}" for i in range(1, stages + 1)), "avgpool"]


def block_params_from_config(regnet_cfg) -> BlockParams:
    """Per-stage settings for ``cfg.MODEL.TRUNK.REGNET`` (a published NAME or "custom")."""
    # torchvision computes the widths with tensors and reads them back with .tolist(): pin them
    # to the CPU so that building the model on the meta device (per-unit init) works.
    with torch.device("cpu"):
        return BlockParams.from_init_params(*design_space(regnet_cfg))


def design_space(regnet_cfg) -> tuple:
    """``BlockParams.from_init_params``' arguments (depth, w_0, w_a, w_m, group_width,
    bottleneck_multiplier, se_ratio) for ``cfg.MODEL.TRUNK.REGNET``; ValueError (one line)."""
    name = regnet_cfg.NAME
    if name == "custom":
        depth, w_0, w_a, w_m = regnet_cfg.DEPTH, regnet_cfg.W_0, regnet_cfg.W_A, regnet_cfg.W_M
        group_width, se_ratio = regnet_cfg.GROUP_WIDTH, regnet_cfg.SE_RATIO or None
        bottleneck = regnet_cfg.BOTTLENECK_MULTIPLIER
    elif name in PUBLISHED_REGNETS:
        depth, w_0, w_a, w_m, group_width, se_ratio = PUBLISHED_REGNETS[name]
        bottleneck = 1.0
    else:
        valid = ", ".join(["custom"] + sorted(PUBLISHED_REGNETS))
        raise ValueError(f"unknown MODEL.TRUNK.REGNET.NAME {name!r}; valid names: {valid}")
    if depth <= 0 or group_width <= 0 or w_0 <= 0 or w_0 % 8 or w_a < 0 or w_m <= 1:
        raise ValueError(
            "invalid RegNet parameters: need DEPTH > 0, GROUP_WIDTH > 0, "
            "W_0 a positive multiple of 8, "
            f"W_A >= 0, W_M > 1 (got DEPTH={depth}, W_0={w_0}, W_A={w_a}, W_M={w_m}, "
            f"GROUP_WIDTH={group_width})"
        )
    return depth, w_0, w_a, w_m, group_width, bottleneck, se_ratio


class RegNetTrunk(nn.Module):
    """RegNet without classifier: stem -> stages -> global average pool.

    ``forward(x)``: x (N, 3, H, W) -> {name: feature} for each name in ``out_features``:
    ``"stem"`` (N, C0, H/2, W/2), ``"s<k>"`` output of stage k (N, C_k, H/2^(k+1), W/2^(k+1)),
    ``"avgpool"`` (N, C_last). Features are in the input's dtype (or autocast's).
    ``feature_dims`` maps every available feature name (not only the requested ones) to its
    channel count. Stages after the last requested feature are skipped.
    """

    def __init__(self, block_params: BlockParams, stem_width: int, out_features: Sequence[str]):
        super().__init__()
        self.stem = SimpleStemIN(3, stem_width, nn.BatchNorm2d, nn.ReLU)
        stages, width_in = [], stem_width
        for i, (width, stride, depth, group_width, bottleneck) in enumerate(
            regnet_stage_settings(block_params), start=1
        ):
            stage = AnyStage(
                width_in, width, stride, depth, ResBottleneckBlock, nn.BatchNorm2d, nn.ReLU,
                group_width, bottleneck, block_params.se_ratio, stage_index=i,
            )  # fmt: skip
            stages.append((f"block{i}", stage))
            width_in = width
        self.trunk_output = nn.Sequential(OrderedDict(stages))
        self.avgpool = nn.AdaptiveAvgPool2d((1, 1))

        self.feature_dims: Dict[str, int] = {"stem": stem_width}
        self.feature_dims.update({f"s{i}": w for i, w in enumerate(block_params.widths, start=1)})
        self.feature_dims["avgpool"] = width_in
        self.out_features = check_out_features(out_features, list(self.feature_dims))
        self.num_lr_layers = len(stages) + 1  # layer-wise lr decay: see lr_layer_of
        _init_weights(self)

    def lr_layer_of(self, name: str) -> int:
        """Layer of parameter ``name`` (relative to the trunk) for layer-wise lr decay: the stem 0,
        stage k (``trunk_output.block<k>``) k; the head's layer is ``num_lr_layers``."""
        if name.startswith("trunk_output.block"):
            return int(name.split(".")[1][len("block") :])
        return 0

    def forward(self, x: torch.Tensor) -> Dict[str, torch.Tensor]:
        wanted, out = set(self.out_features), {}
        x = self.stem(x)
        if "stem" in wanted:
            out["stem"] = x
        for i, stage in enumerate(self.trunk_output, start=1):
            if len(out) == len(wanted):
                break  # nothing later is requested: don't pay for the remaining stages
            x = stage(x)
            if f"s{i}" in wanted:
                out[f"s{i}"] = x
        if "avgpool" in wanted:
            out["avgpool"] = torch.flatten(self.avgpool(x), 1)
        return out


def _init_weights(module: nn.Module) -> None:
    # torchvision's He-normal (fan-out) init, so both start from the same distribution.
    for m in module.modules():
        if isinstance(m, nn.Conv2d):
            fan_out = m.kernel_size[0] * m.kernel_size[1] * m.out_channels
            nn.init.normal_(m.weight, mean=0.0, std=math.sqrt(2.0 / fan_out))
        elif isinstance(m, nn.BatchNorm2d):
            nn.init.ones_(m.weight)
            nn.init.zeros_(m.bias)


def build_regnet(trunk_cfg) -> RegNetTrunk:
    """Trunk for ``cfg.MODEL.TRUNK`` (uses its REGNET section and OUT_FEATURES)."""
    regnet_cfg = trunk_cfg.REGNET
    custom = regnet_cfg.NAME == "custom"
    stem_width = regnet_cfg.STEM_WIDTH if custom else PUBLISHED_STEM_WIDTH
    if stem_width <= 0:
        raise ValueError(f"MODEL.TRUNK.REGNET.STEM_WIDTH must be positive, got {stem_width}")
    return RegNetTrunk(block_params_from_config(regnet_cfg), stem_width, trunk_cfg.OUT_FEATURES)


def to_torchvision_state_dict(trunk_state_dict: Dict[str, torch.Tensor], prefix: str = "") -> Dict:
    """Trunk state dict -> state dict of the matching ``torchvision.models.RegNet`` without ``fc``.

    Keys already use torchvision's names; this strips ``prefix`` (e.g. ``"trunk."`` for a whole
    SSLModel state dict; keys not starting with it are dropped) and checks that every remaining
    key belongs to the stem or a stage. The classifier is not part of a trunk, so load with
    ``tv_model.fc = nn.Identity()`` first (then ``tv_model(x)`` returns our ``"avgpool"``
    feature), or ``load_state_dict(sd, strict=False)`` and check that only ``fc.*`` is missing.
    """
    return torchvision_keys(trunk_state_dict, prefix, TORCHVISION_PREFIXES, "RegNet")


def describe(block_params: BlockParams) -> Dict[str, Optional[List]]:
    """Per-stage settings as plain lists (logs, tests)."""
    return {
        "depths": list(block_params.depths),
        "widths": list(block_params.widths),
        "group_widths": list(block_params.group_widths),
        "bottleneck_multipliers": list(block_params.bottleneck_multipliers),
        "se_ratio": block_params.se_ratio,
    }


def load_line(trunk_cfg, library: str, path: str) -> str:
    """The lines that build the torchvision RegNet of ``trunk_cfg`` (its builder for a published
    size torchvision has, else ``RegNet(BlockParams.from_init_params(...), stem_width)``) and
    load the torchvision export ``path``."""
    if library != "torchvision":
        raise ValueError(f"a RegNet trunk has a torchvision model, not a {library} one")
    regnet_cfg = trunk_cfg.REGNET
    if regnet_cfg.NAME in PUBLISHED_REGNETS and hasattr(torchvision.models, regnet_cfg.NAME):
        build = f"torchvision.models.{regnet_cfg.NAME}()"
    else:
        stem = regnet_cfg.STEM_WIDTH if regnet_cfg.NAME == "custom" else PUBLISHED_STEM_WIDTH
        args = ", ".join(map(repr, design_space(regnet_cfg)))
        build = (
            "torchvision.models.regnet.RegNet(torchvision.models.regnet.BlockParams.from_init_params("
            f"{args}), stem_width={stem})"
        )
    return torchvision_load_line(build, "fc", path)


REGNET = TrunkFamily(
    build=build_regnet,
    feature_names=lambda trunk_cfg: feature_names(trunk_cfg.REGNET),
    units={"block": (ResBottleneckBlock, SimpleStemIN), "stage": (AnyStage, SimpleStemIN)},
    checkpointed={"block": (ResBottleneckBlock,), "stage": (AnyStage,)},
    torchvision_prefixes=TORCHVISION_PREFIXES,
    to_torchvision=to_torchvision_state_dict,
    names={"regnets": [*PUBLISHED_REGNETS, "custom"]},
    load_line=load_line,
)
