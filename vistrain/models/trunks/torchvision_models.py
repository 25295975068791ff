"""Any classification model of ``torchvision.models`` as a trunk (``MODEL.TRUNK.NAME: torchvision``).

``MODEL.TRUNK.TORCHVISION.NAME`` is a builder of ``torchvision.models`` (``convnext_tiny``,
``efficientnet_b0``, ``mobilenet_v3_small``, ``swin_t``...), ``MODEL.TRUNK.TORCHVISION.KWARGS`` its
keyword arguments. The model is kept at ``trunk.torchvision`` with the classifier's last layer
(the last ``Linear``, or 1x1 ``Conv2d``, producing the class scores) replaced by ``nn.Identity``:
its parameter names stay torchvision's, so weights go in and out in torchvision's keys
(``torchvision.models.<name>()`` loads an export once its classifier's last layer is set to
``nn.Identity``, as the export's model card writes). ``MODEL.TRUNK.IN_CHANNELS`` other than 3 replaces the first convolution by one
of that many input channels (torch's default initialisation).

Features:

* ``avgpool`` (N, C): the model's output without the classifier's last layer (its global pool,
  and for ConvNeXt its final norm, MobileNetV3 its hidden classifier layer);
* ``stage1..stageK`` (N, C, h, w): for convolutional models, the output of the last block at each
  new resolution (the blocks found from the structure), as timm's ``feature_info``; read with
  forward hooks on those blocks.
"""

import difflib
from typing import Dict, List, Optional, Tuple

import torch
import torchvision
from torch import nn

from vistrain.models.trunks.family import TrunkFamily
from vistrain.models.trunks.library import LibraryTrunk, keyword_arguments, meta_build
from vistrain.models.trunks.structure import classes_named, repeated_blocks

PROBE_SIDE = 224  # the side of the probe image that finds the stages (torchvision's ViT needs 224)


def classification_models() -> List[str]:
    return sorted(torchvision.models.list_models(module=torchvision.models))


def create(trunk_cfg) -> Tuple[nn.Module, int]:
    """(``torchvision.models.<NAME>(**KWARGS)`` without weights nor the classifier's last layer,
    the width of its output); ValueError (one line) for an unknown name (listing close ones) or
    arguments the builder refuses."""
    name, kwargs = (
        trunk_cfg.TORCHVISION.NAME,
        keyword_arguments(trunk_cfg.TORCHVISION.KWARGS, "MODEL.TRUNK.TORCHVISION.KWARGS"),
    )
    valid = classification_models()
    if name not in valid:
        close = difflib.get_close_matches(name, valid, n=6, cutoff=0.5) or valid[:10]
        raise ValueError(f"unknown MODEL.TRUNK.TORCHVISION.NAME {name!r}; close names: {', '.join(close)}")
    if "weights" in kwargs:
        raise ValueError(
            "MODEL.TRUNK.TORCHVISION.KWARGS.weights: weights load through MODEL.WEIGHTS_INIT.PARAMS_FILE; remove it"
        )
    try:
        model = _get_model(name, kwargs)
    except TypeError as e:
        raise ValueError(f"torchvision.models.{name} refused MODEL.TRUNK.TORCHVISION.KWARGS: {e}") from None
    width = drop_classifier(model)
    if trunk_cfg.IN_CHANNELS != 3:
        set_input_channels(model, trunk_cfg.IN_CHANNELS)
    return model, width


def _get_model(name: str, kwargs: dict) -> nn.Module:
    """``torchvision.models.get_model``; a builder that computes on tensors (RegNet's widths),
    asked for a meta-device model (the planner's), builds on the CPU and moves to the meta device
    (a per-unit build then finds no record and builds the model whole)."""
    try:
        return torchvision.models.get_model(name, **kwargs)
    except NotImplementedError:
        if torch.empty(0).device.type != "meta":
            raise
        with torch.device("cpu"):
            model = torchvision.models.get_model(name, **kwargs)
        return model.to("meta")


def _classifier(model: nn.Module) -> Tuple[str, nn.Module]:
    """(name, module) of the layer producing the class scores: the last Linear or Conv2d."""
    layers = [(n, m) for n, m in model.named_modules() if isinstance(m, (nn.Linear, nn.Conv2d))]
    return layers[-1]


def drop_classifier(model: nn.Module) -> int:
    """Replace the classifier's last layer by ``nn.Identity``; returns its input width."""
    fqn, layer = _classifier(model)
    width = layer.in_features if isinstance(layer, nn.Linear) else layer.in_channels
    parent_name, _, child = fqn.rpartition(".")
    setattr(model.get_submodule(parent_name), child, nn.Identity())
    return width


def set_input_channels(model: nn.Module, channels: int) -> None:
    """Replace the first convolution by one taking ``channels`` inputs (same other arguments;
    torch's default initialisation)."""
    fqn, conv = next((n, m) for n, m in model.named_modules() if isinstance(m, nn.Conv2d))
    new = nn.Conv2d(
        channels, conv.out_channels, conv.kernel_size, conv.stride, conv.padding, conv.dilation,
        conv.groups, conv.bias is not None, conv.padding_mode,
    )  # fmt: skip
    parent_name, _, child = fqn.rpartition(".")
    setattr(model.get_submodule(parent_name), child, new)


def _is_map(shape: torch.Size) -> bool:
    """An (N, C, h, w) output of the square probe image (not a token sequence, nor a channels-last
    (N, h, w, C) map: Swin's)."""
    return (
        len(shape) == 4 and shape[-1] == shape[-2] and PROBE_SIDE % shape[-1] == 0 and shape[1] != shape[-1]
    )


def stage_modules(model: nn.Module, channels: int) -> List[Tuple[str, int]]:
    """(module name, channels) of the last block at each new resolution of a square probe
    image, for blocks whose outputs are (N, C, h, w) maps ([] for token models). ``model`` is
    left in the training mode it had."""
    blocks = repeated_blocks(model)["stage"]
    names = {m: n for n, m in model.named_modules() if blocks and isinstance(m, blocks)}
    shapes: Dict[str, torch.Size] = {}
    hooks = [
        m.register_forward_hook(lambda mod, args, out, n=n: shapes.__setitem__(n, out.shape))
        for m, n in names.items()
    ]
    device, training = next(model.parameters()).device, model.training
    try:
        with torch.no_grad():
            model.eval()(torch.zeros(1, channels, PROBE_SIDE, PROBE_SIDE, device=device))
    finally:
        model.train(training)
        for h in hooks:
            h.remove()
    last: Dict[int, Tuple[str, int]] = {}
    for name, shape in shapes.items():  # in call order: the last block at a resolution wins
        if _is_map(shape):
            last[shape[-1]] = (name, int(shape[1]))
    return list(last.values())


def _layout(trunk_cfg) -> Tuple[List[Tuple[str, int]], int]:
    """(stages, avgpool width) of ``trunk_cfg``'s model, probed on the meta device where the
    model builds there (else on a CPU build); ValueError (one line) for a BLOCKS class the model
    does not have."""
    with torch.random.fork_rng(devices=[]):  # the probe draws nothing the trunk's build would see
        model, width = meta_build(create, trunk_cfg) or create(trunk_cfg)
        if trunk_cfg.TORCHVISION.BLOCKS:
            classes_named(model, trunk_cfg.TORCHVISION.BLOCKS, "MODEL.TRUNK.TORCHVISION.BLOCKS")
        return stage_modules(model, trunk_cfg.IN_CHANNELS), width


class TorchvisionTrunk(LibraryTrunk):
    """A torchvision model without its classifier's last layer (``self.torchvision``).
    ``forward(x)``: x (N, IN_CHANNELS, H, W) -> {name: feature} for ``out_features``."""

    def __init__(self, model: nn.Module, stages: List[Tuple[str, int]], width: int, out_features, blocks=()):
        super().__init__()
        self.torchvision = model
        self.stage_modules = {f"stage{i + 1}": name for i, (name, _) in enumerate(stages)}
        dims = {f"stage{i + 1}": c for i, (_, c) in enumerate(stages)}
        dims["avgpool"] = width
        self.setup(model, dims, ["avgpool"], out_features, blocks, f"torchvision {type(model).__name__}")
        self._captured: Optional[Dict[str, torch.Tensor]] = None  # a dict during forward only
        for feature, name in self.stage_modules.items():
            if feature in self.out_features:
                model.get_submodule(name).register_forward_hook(self._capture(feature))

    def _capture(self, feature: str):
        def hook(module, args, output):
            if self._captured is not None:  # not in activation checkpointing's recomputation
                self._captured[feature] = output

        return hook

    def forward(self, x: torch.Tensor) -> Dict[str, torch.Tensor]:
        self._captured = {}
        try:
            pooled = self.torchvision(x)
            out = self._captured
        finally:
            self._captured = None
        if "avgpool" in self.out_features:
            out["avgpool"] = pooled.flatten(1)
        return out


def build_torchvision(trunk_cfg) -> TorchvisionTrunk:
    """Trunk for ``cfg.MODEL.TRUNK`` (its TORCHVISION section, IN_CHANNELS and OUT_FEATURES)."""
    stages, _ = _layout(trunk_cfg)
    model, width = create(trunk_cfg)
    return TorchvisionTrunk(model, stages, width, trunk_cfg.OUT_FEATURES, trunk_cfg.TORCHVISION.BLOCKS)


def feature_names(trunk_cfg) -> List[str]:
    """Every feature the torchvision model of ``trunk_cfg`` offers (a meta-device build)."""
    stages, _ = _layout(trunk_cfg)
    return [*(f"stage{i + 1}" for i in range(len(stages))), "avgpool"]


def to_torchvision_state_dict(trunk_state_dict: Dict, prefix: str = "") -> Dict:
    """Trunk state dict -> the torchvision model's state dict without the classifier's last layer
    (loaded by the lines of :func:`load_line`)."""
    start = prefix + "torchvision."
    out = {k[len(start) :]: v for k, v in trunk_state_dict.items() if k.startswith(start)}
    if not out:
        raise ValueError(f"no torchvision trunk keys found (prefix {start!r})")
    return out


def load_line(trunk_cfg, library: str, path: str) -> str:
    """The lines that build this trunk in torchvision and load the exported file ``path``: the
    classifier's last layer replaced by ``nn.Identity`` (then ``model(x)`` is our ``avgpool``)."""
    kwargs = keyword_arguments(trunk_cfg.TORCHVISION.KWARGS, "MODEL.TRUNK.TORCHVISION.KWARGS")
    name = trunk_cfg.TORCHVISION.NAME
    build = lambda: torchvision.models.get_model(name, **kwargs)
    fqn, _ = _classifier(meta_build(build) or build())
    layer = "model" + "".join(f"[{p}]" if p.isdigit() else f".{p}" for p in fqn.split("."))
    load = "safetensors.torch.load_file" if path.endswith(".safetensors") else "torch.load"
    args = ", ".join(f"{k}={v!r}" for k, v in kwargs.items())
    return (
        f"model = torchvision.models.{name}({args}); {layer} = torch.nn.Identity(); "
        f"model.load_state_dict({load}({path!r}))"
    )


TORCHVISION = TrunkFamily(
    build=build_torchvision,
    feature_names=feature_names,
    units={},  # the blocks of the built model: LibraryTrunk.block_classes
    checkpointed={},
    torchvision_prefixes=("torchvision",),
    to_torchvision=to_torchvision_state_dict,
    load_line=load_line,
    builds_in_channels=True,
)
