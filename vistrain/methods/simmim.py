"""SimMIM (Xie et al., 2022): "a simple framework for masked image modeling". Random units of
``mask_patch_size`` pixels (32 in the paper) are masked, ``mask_ratio`` 0.6 of them; the ViT
encoder sees every patch, a masked one's embedding replaced by the trunk's learned mask token
(MODEL.TRUNK.VIT.MASK_TOKEN or TIMM.MASK_TOKEN) before the position embeddings; a linear decoder
(``simmim_decoder``: a 1x1 convolution of the patch features to P*P*3 values and a pixel shuffle)
predicts the raw pixels, scored by the L1 loss on the masked pixels (``vistrain/losses/simmim.py``).
One view per image. No teacher. As the authors' ``SimMIM`` and ``MaskGenerator``
(microsoft/SimMIM, ``models/simmim.py``, ``data/data_simmim.py``).

The masks are drawn per image and per step from the criterion's own generator, seeded from the
run's seed and the rank, and saved in every checkpoint with the rank's other state (as MAE's).
"""

from typing import Dict, Optional, Sequence

import torch
from fvcore.common.config import CfgNode
from torch import nn

from vistrain.config.checks import at_least, below
from vistrain.config.errors import ConfigError
from vistrain.distributed import comm
from vistrain.losses.simmim import simmim_loss, simmim_masks
from vistrain.methods.base import Criterion, Head, Method
from vistrain.models.trunks import token_layout


def section() -> CfgNode:
    """LOSS.simmim_loss."""
    c = CfgNode()
    c.mask_ratio = 0.6  # share of the mask units masked in each image (SimMIM: 0.6)
    c.mask_patch_size = 32  # side of a mask unit in pixels, a multiple of the ViT's patch (SimMIM: 32)
    return c


class SimMIMDecoder(nn.Module):
    """SimMIM's "linear" prediction head: ``forward(sequence, mask=None)``: sequence (N, prefix +
    L, D), the encoder's tokens after its final norm -> (N, 3, h P, w P) pixels, L = h * w
    (a square grid): the patch tokens as an (N, D, h, w) map, a 1x1 convolution to P*P*3
    channels, ``PixelShuffle(P)``. ``mask`` is the trunk's; the head reads every patch."""

    in_feature = "sequence"

    def __init__(self, width: int, patch_size: int, num_prefix: int):
        super().__init__()
        self.num_prefix, self.patch_size = num_prefix, patch_size
        self.predict = nn.Conv2d(width, patch_size**2 * 3, kernel_size=1)
        self.shuffle = nn.PixelShuffle(patch_size)

    def forward(self, sequence: torch.Tensor, mask: Optional[torch.Tensor] = None) -> torch.Tensor:
        patches = sequence[:, self.num_prefix :]
        n, length, width = patches.shape
        side = int(round(length**0.5))
        if side * side != length:
            raise ValueError(f"the simmim_decoder needs a square patch grid, got {length} patches")
        return self.shuffle(self.predict(patches.transpose(1, 2).reshape(n, width, side, side)))


def build_head(head_cfg, trunk: nn.Module) -> SimMIMDecoder:
    if not hasattr(trunk, "patch_size"):
        raise ConfigError(
            "the simmim_decoder head reads a ViT's patches: set MODEL.TRUNK.NAME=vit (or timm with a VisionTransformer)"
        )
    dims = list(head_cfg.DIMS)
    if len(dims) != 1:
        raise ConfigError(f"the simmim_decoder head takes MODEL.HEAD.DIMS=[encoder width], got {dims}")
    return SimMIMDecoder(int(dims[0]), trunk.patch_size, trunk.num_prefix)


class SimMIMCriterion(Criterion):
    """SimMIM on the decoder's pixels (N, 3, H, W) of the one crop per image: ``masking`` draws
    the (N, L) mask for the crop and remembers the crop and the mask; ``forward`` scores the
    masked pixels. The generator is this rank's and part of ``state_dict()``."""

    def __init__(self, simmim_cfg, model_cfg=None):
        super().__init__()
        if model_cfg is None:
            raise ValueError("simmim_loss needs MODEL (build it with build_method(cfg))")
        layout = token_layout(model_cfg.TRUNK)
        if isinstance(layout, str):
            raise ConfigError(f"LOSS.NAME=simmim_loss masks a ViT's patches: {layout}")
        self.patch_size = layout.patch_size
        self.mask_ratio = float(simmim_cfg.mask_ratio)
        self.mask_patch_size = int(simmim_cfg.mask_patch_size)
        # the run's seed (set before the criterion is built) and the rank: independent masks per rank
        self.generator = torch.Generator().manual_seed(torch.initial_seed() + 7919 * comm.get_rank())
        self._pending: Optional[tuple] = None  # (images, mask) of the last masking()

    def masking(self, crops: Sequence[torch.Tensor]) -> Dict[str, torch.Tensor]:
        """``mask`` (N, L) bool for the one crop (N, 3, H, W)."""
        if len(crops) != 1:
            raise ValueError(f"simmim_loss takes one crop per image, got {len(crops)}")
        images = crops[0]
        p = self.patch_size
        grid = (images.shape[-2] // p, images.shape[-1] // p)
        mask = simmim_masks(images.shape[0], grid, self.mask_patch_size // p, self.mask_ratio, self.generator)
        self._pending = (images, mask)
        return {"mask": mask if images.device.type == "meta" else mask.to(images.device)}

    def forward(self, model_output: torch.Tensor, num_crops: int, teacher_output=None) -> torch.Tensor:
        pending, self._pending = self._pending, None
        if pending is None:
            raise ValueError("simmim_loss scores the crop masking() masked: call it before the model")
        images, mask = pending
        return simmim_loss(images, model_output, mask.to(model_output.device), self.patch_size)

    def get_extra_state(self):
        return {"generator": self.generator.get_state()}

    def set_extra_state(self, state) -> None:
        self.generator.set_state(state["generator"])


def masked_vit(cfg) -> Optional[str]:
    """A method check: SimMIM masks the patches of a ViT with a mask token, in units that tile the
    crop, and its decoder reads the "sequence" feature."""
    trunk, section_cfg = cfg.MODEL.TRUNK, cfg.LOSS.simmim_loss
    layout = token_layout(trunk)
    if isinstance(layout, str):
        return f"LOSS.NAME=simmim_loss masks a ViT's patches: {layout} (now MODEL.TRUNK.NAME={trunk.NAME})"
    if not layout.mask_token:
        key = "TIMM" if trunk.NAME == "timm" else "VIT"
        return f"LOSS.NAME=simmim_loss replaces masked patches by a mask token: set MODEL.TRUNK.{key}.MASK_TOKEN=True"
    if "sequence" not in trunk.OUT_FEATURES:
        return (
            f"LOSS.NAME=simmim_loss decodes the ViT's token sequence: add sequence to MODEL.TRUNK.OUT_FEATURES "
            f"(now {list(trunk.OUT_FEATURES)})"
        )
    unit, sizes = section_cfg.mask_patch_size, list(cfg.DATA.TRAIN.TRANSFORMS.SIZE_CROPS)
    if unit % layout.patch_size or any(size % unit for size in sizes):
        return (
            f"LOSS.simmim_loss.mask_patch_size={unit} must be a multiple of the ViT's patch "
            f"({layout.patch_size}) dividing DATA.TRAIN.TRANSFORMS.SIZE_CROPS={sizes}: set it to one"
        )
    return None


HEAD = Head("simmim_decoder", build_head, sized_by_trunk=True)

METHOD = Method(
    name="simmim_loss",
    criterion=SimMIMCriterion,
    head=HEAD,
    section=section,
    rules={"mask_ratio": [at_least(0.0), below(1.0)], "mask_patch_size": [at_least(1)]},
    checks=(masked_vit,),
    min_crops=1,
    max_crops=1,
)
