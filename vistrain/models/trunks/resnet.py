"""ResNet trunk (He et al., 2016) and its wide / ResNeXt variants, from torchvision's blocks.

A ResNet is a stem (7x7 stride-2 convolution, BatchNorm, ReLU, 3x3 stride-2 max pool) and four
stages of residual blocks ``y = relu(x + F(x))`` with ``64 * 2^k`` base channels (stage k = 0..3),
stages 2..4 halving the resolution in their first block. ``F`` is two 3x3 convolutions
(``BasicBlock``: resnet18/34) or a 1x1-3x3-1x1 bottleneck expanding 4x (``Bottleneck``; ResNeXt
groups the 3x3, wide ResNets double its width). We reuse torchvision's ``BasicBlock`` /
``Bottleneck`` and its initialisation, so that

* parameter names are torchvision's (``conv1``, ``bn1``, ``layer1..layer4.<j>.*``): a trunk of a
  published design loads into ``torchvision.models.<name>()`` (see :func:`to_torchvision_state_dict`);
* a sharding wrap policy can select every residual block (or every stage) by class.

For small images, ``WIDTH_MULTIPLIER`` scales every width and ``SMALL_STEM`` replaces the stem by
a 3x3 stride-1 convolution without max pool (SimCLR's CIFAR variant); the torchvision export then
only loads into a torchvision model of the same shapes.
"""

from collections import OrderedDict
from typing import Dict, List, Sequence, Type, Union

import torch
from torch import nn
from torchvision.models.resnet import BasicBlock, Bottleneck, conv1x1

from vistrain.models.trunks.family import (
    TrunkFamily,
    check_out_features,
    torchvision_keys,
    torchvision_load_line,
    unknown_name,
)

Block = Type[Union[BasicBlock, Bottleneck]]
# name -> (block, blocks per stage, groups, width per group): torchvision's builders' arguments
PUBLISHED_RESNETS = {
    "resnet18": (BasicBlock, (2, 2, 2, 2), 1, 64),
    "resnet34": (BasicBlock, (3, 4, 6, 3), 1, 64),
    "resnet50": (Bottleneck, (3, 4, 6, 3), 1, 64),
    "resnet101": (Bottleneck, (3, 4, 23, 3), 1, 64),
    "resnet152": (Bottleneck, (3, 8, 36, 3), 1, 64),
    "resnext50_32x4d": (Bottleneck, (3, 4, 6, 3), 32, 4),
    "resnext101_32x8d": (Bottleneck, (3, 4, 23, 3), 32, 8),
    "resnext101_64x4d": (Bottleneck, (3, 4, 23, 3), 64, 4),
    "wide_resnet50_2": (Bottleneck, (3, 4, 6, 3), 1, 128),
    "wide_resnet101_2": (Bottleneck, (3, 4, 23, 3), 1, 128),
}
FEATURES = ["conv1", "res2", "res3", "res4", "res5", "avgpool"]  # stem, the four stages, pooled
TORCHVISION_PREFIXES = ("conv1", "bn1", "layer1", "layer2", "layer3", "layer4")


class ResStage(nn.Sequential):
    """A stage's residual blocks (``layer<k>``): an ``nn.Sequential`` of its own class, so that a
    wrap policy or activation checkpointing can select stages."""


def widths(resnet_cfg) -> List[int]:
    """[stem, stage 1..4] output channels of ``cfg.MODEL.TRUNK.RESNET``; ValueError (one line)
    for an unknown NAME or a multiplier that leaves a width below 1."""
    if resnet_cfg.NAME not in PUBLISHED_RESNETS:
        raise unknown_name("MODEL.TRUNK.RESNET.NAME", resnet_cfg.NAME, list(PUBLISHED_RESNETS))
    block = PUBLISHED_RESNETS[resnet_cfg.NAME][0]
    stem, *planes = (_scaled(64 * 2**k, resnet_cfg.WIDTH_MULTIPLIER) for k in (0, 0, 1, 2, 3))
    return [stem, *(p * block.expansion for p in planes)]


def _scaled(width: int, multiplier: float) -> int:
    scaled = int(round(width * multiplier))
    if scaled < 1:
        raise ValueError(f"MODEL.TRUNK.RESNET.WIDTH_MULTIPLIER {multiplier} leaves a width of {scaled}")
    return scaled


def feature_names(trunk_cfg) -> List[str]:
    """The features a ResNet offers: conv1 (the stem), res2..res5 (the stages), avgpool."""
    widths(trunk_cfg.RESNET)  # checks the name and multiplier
    return list(FEATURES)


class ResNetTrunk(nn.Module):
    """ResNet without classifier: stem -> layer1..layer4 -> global average pool.

    ``forward(x)``: x (N, 3, H, W) -> {name: feature} for each name in ``out_features``:
    ``"conv1"`` the stem's output (N, C0, H/4, W/4; H, W with ``small_stem``), ``"res<k>"`` the
    output of stage k-1 (N, C_k, H/2^k, W/2^k; 2^(k-2) with ``small_stem``), ``"avgpool"``
    (N, C_5). ``feature_dims`` maps every feature name to its channels. Stages after the last
    requested feature are skipped.
    """

    def __init__(
        self,
        block: Block,
        layers: Sequence[int],
        groups: int,
        width_per_group: int,
        width_multiplier: float,
        small_stem: bool,
        zero_init_residual: bool,
        out_features: Sequence[str],
    ):
        super().__init__()
        stem = _scaled(64, width_multiplier)
        if small_stem:
            self.conv1 = nn.Conv2d(3, stem, kernel_size=3, stride=1, padding=1, bias=False)
        else:
            self.conv1 = nn.Conv2d(3, stem, kernel_size=7, stride=2, padding=3, bias=False)
        self.bn1 = nn.BatchNorm2d(stem)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.Identity() if small_stem else nn.MaxPool2d(kernel_size=3, stride=2, padding=1)
        width_in = stem
        for k, depth in enumerate(layers):
            planes = _scaled(64 * 2**k, width_multiplier)
            stage = _stage(block, width_in, planes, depth, 1 if k == 0 else 2, groups, width_per_group)
            setattr(self, f"layer{k + 1}", stage)
            width_in = planes * block.expansion
        self.avgpool = nn.AdaptiveAvgPool2d((1, 1))

        self.feature_dims: Dict[str, int] = {"conv1": stem}
        self.feature_dims.update(
            {f"res{k + 2}": _scaled(64 * 2**k, width_multiplier) * block.expansion for k in range(4)}
        )
        self.feature_dims["avgpool"] = width_in
        self.out_features = check_out_features(out_features, list(self.feature_dims))
        self.num_lr_layers = len(layers) + 1  # layer-wise lr decay: see lr_layer_of
        _init_weights(self, zero_init_residual)

    def lr_layer_of(self, name: str) -> int:
        """Layer of parameter ``name`` (relative to the trunk) for layer-wise lr decay: the stem
        (``conv1``, ``bn1``) 0, ``layer<k>`` k; the head's layer is ``num_lr_layers``."""
        if name.startswith("layer"):
            return int(name.split(".")[0][len("layer") :])
        return 0

    def forward(self, x: torch.Tensor) -> Dict[str, torch.Tensor]:
        wanted, out = set(self.out_features), {}
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        if "conv1" in wanted:
            out["conv1"] = x
        for k, stage in enumerate((self.layer1, self.layer2, self.layer3, self.layer4), start=2):
            if len(out) == len(wanted):
                break  # nothing later is requested
            x = stage(x)
            if f"res{k}" in wanted:
                out[f"res{k}"] = x
        if "avgpool" in wanted:
            out["avgpool"] = torch.flatten(self.avgpool(x), 1)
        return out


def _stage(
    block: Block, width_in: int, planes: int, depth: int, stride: int, groups: int, width_per_group: int
) -> ResStage:
    """torchvision's ``ResNet._make_layer`` (without dilation): a 1x1 projection shortcut on the
    first block when the shape changes."""
    downsample = None
    if stride != 1 or width_in != planes * block.expansion:
        downsample = nn.Sequential(
            conv1x1(width_in, planes * block.expansion, stride), nn.BatchNorm2d(planes * block.expansion)
        )
    blocks = [block(width_in, planes, stride, downsample, groups, width_per_group)]
    blocks += [
        block(planes * block.expansion, planes, groups=groups, base_width=width_per_group)
        for _ in range(1, depth)
    ]
    return ResStage(OrderedDict((str(j), b) for j, b in enumerate(blocks)))


def _init_weights(module: nn.Module, zero_init_residual: bool) -> None:
    # torchvision's ResNet init: He-normal (fan-out) convolutions, BatchNorm 1 / 0; optionally the
    # last BatchNorm of each residual branch at 0 (each block starts as the identity; Goyal et al.)
    for m in module.modules():
        if isinstance(m, nn.Conv2d):
            nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
        elif isinstance(m, nn.BatchNorm2d):
            nn.init.constant_(m.weight, 1)
            nn.init.constant_(m.bias, 0)
    if zero_init_residual:
        for m in module.modules():
            if isinstance(m, (Bottleneck, BasicBlock)):
                nn.init.constant_(m.bn3.weight if isinstance(m, Bottleneck) else m.bn2.weight, 0)


def build_resnet(trunk_cfg) -> ResNetTrunk:
    """Trunk for ``cfg.MODEL.TRUNK`` (uses its RESNET section and OUT_FEATURES)."""
    resnet_cfg = trunk_cfg.RESNET
    widths(resnet_cfg)  # one-line errors for the name and multiplier
    block, layers, groups, width_per_group = PUBLISHED_RESNETS[resnet_cfg.NAME]
    return ResNetTrunk(
        block, layers, groups, width_per_group, resnet_cfg.WIDTH_MULTIPLIER, resnet_cfg.SMALL_STEM,
        resnet_cfg.ZERO_INIT_RESIDUAL, trunk_cfg.OUT_FEATURES,
    )  # fmt: skip


def to_torchvision_state_dict(trunk_state_dict: Dict[str, torch.Tensor], prefix: str = "") -> Dict:
    """Trunk state dict -> state dict of ``torchvision.models.<RESNET.NAME>()`` without ``fc``
    (keys are already torchvision's; ``prefix`` is stripped as for RegNet). Load with
    ``tv.fc = nn.Identity()``; then ``tv(x)`` is our ``"avgpool"`` feature. With a
    WIDTH_MULTIPLIER other than 1 or SMALL_STEM the shapes differ from the published model's."""
    return torchvision_keys(trunk_state_dict, prefix, TORCHVISION_PREFIXES, "ResNet")


def load_line(trunk_cfg, library: str, path: str) -> str:
    """The lines that build ``torchvision.models.<RESNET.NAME>()`` and load the torchvision export
    ``path``; ValueError for a trunk whose shapes no torchvision builder has (WIDTH_MULTIPLIER,
    SMALL_STEM)."""
    resnet_cfg = trunk_cfg.RESNET
    if library != "torchvision":
        raise ValueError(f"a ResNet trunk has a torchvision model, not a {library} one")
    if resnet_cfg.WIDTH_MULTIPLIER != 1 or resnet_cfg.SMALL_STEM:
        raise ValueError(
            f"no torchvision builder makes {resnet_cfg.NAME} with WIDTH_MULTIPLIER "
            f"{resnet_cfg.WIDTH_MULTIPLIER} and SMALL_STEM {resnet_cfg.SMALL_STEM}: build a torchvision "
            "ResNet of the trunk's shapes, then load the file"
        )
    return torchvision_load_line(f"torchvision.models.{resnet_cfg.NAME}()", "fc", path)


RESNET = TrunkFamily(
    build=build_resnet,
    feature_names=feature_names,
    units={"block": (BasicBlock, Bottleneck), "stage": (ResStage,)},
    checkpointed={"block": (BasicBlock, Bottleneck), "stage": (ResStage,)},
    torchvision_prefixes=TORCHVISION_PREFIXES,
    to_torchvision=to_torchvision_state_dict,
    names={"resnets": list(PUBLISHED_RESNETS)},
    load_line=load_line,
)
