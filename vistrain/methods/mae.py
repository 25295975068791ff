"""MAE (He et al., 2022): "mask random patches of the input image and reconstruct the missing
pixels". The ViT encoder sees only the kept patches (a quarter, ``mask_ratio`` 0.75); the head is
a light decoder (``mae_decoder``) that puts mask tokens in the masked places and predicts every
patch's pixels; the loss is the MSE on the masked patches (``vistrain/losses/mae.py``), with
``norm_pix_loss`` on per-patch normalised targets. One view per image (crops and flips only in
the paper). No teacher.

The masks are drawn per sample and per step from the criterion's own generator, seeded from the
run's seed and the rank (so ranks mask their images independently) and saved in every
checkpoint with the rank's other state: a resume on the same ranks draws the same masks.
"""

import functools
from typing import Dict, Optional, Sequence

import torch
from fvcore.common.config import CfgNode
from torch import nn
from torchvision.models.vision_transformer import EncoderBlock

from vistrain.config.checks import at_least, below
from vistrain.config.errors import ConfigError
from vistrain.distributed import comm
from vistrain.losses.mae import mae_loss
from vistrain.methods.base import Criterion, Head, Method
from vistrain.models.masking import patchify, random_keep, sincos_position_embedding
from vistrain.models.trunks import TokenLayout, token_layout
from vistrain.models.trunks.vit import LAYER_NORM_EPS, LayerNorm32


def section() -> CfgNode:
    """LOSS.mae_loss."""
    c = CfgNode()
    c.mask_ratio = 0.75  # share of each image's patches the encoder does not see
    c.norm_pix_loss = True  # targets: each patch's pixels normalised by their own mean and variance
    return c


def head_keys() -> CfgNode:
    """MODEL.HEAD keys of the mae_decoder head (its width is DIMS[1]; DIMS[0] the encoder's)."""
    c = CfgNode()
    c.DECODER_DEPTH = 8  # mae_decoder: transformer blocks (MAE: 8 at width 512)
    c.DECODER_HEADS = 16  # mae_decoder: attention heads, dividing DIMS[1]
    return c


class MAEDecoder(nn.Module):
    """MAE's decoder: "the full set of tokens consisting of (i) encoded visible patches, and (ii)
    mask tokens", position embeddings added to all, transformer blocks, a linear layer to pixels.

    ``forward(encoded, keep)``: encoded (N, prefix + K, D_enc), the encoder's "sequence";
    keep (N, K), the kept patches' indices -> (N, L, P*P*C), every patch's pixels (C: the trunk's input channels) (the prefix
    tokens dropped), L = grid^2. Fixed 2-D sin-cos position embeddings (zeros for the prefix, a
    buffer); a learned mask token; torchvision's ``EncoderBlock`` with fp32 LayerNorms, so the
    ViT's wrap policy makes every decoder block a unit too.
    """

    in_feature = "sequence"

    def __init__(self, dims: Sequence[int], depth: int, heads: int, trunk: nn.Module):
        super().__init__()
        in_width, width = int(dims[0]), int(dims[-1])
        self.grid, self.num_prefix = trunk.grid, trunk.num_prefix
        self.embed = nn.Linear(in_width, width)
        self.mask_token = nn.Parameter(torch.zeros(1, 1, width))
        nn.init.normal_(self.mask_token, std=0.02)
        table = sincos_position_embedding((self.grid, self.grid), width)
        rows = [[0.0] * width] * self.num_prefix + table.tolist()  # a factory a meta build replays
        self.register_buffer("pos_embedding", torch.tensor([rows]))
        norm = functools.partial(LayerNorm32, eps=LAYER_NORM_EPS)
        self.blocks = nn.ModuleList(
            [EncoderBlock(heads, width, 4 * width, 0.0, 0.0, norm) for _ in range(depth)]
        )
        self.norm = norm(width)
        channels = next(
            m.in_channels for m in trunk.modules() if isinstance(m, nn.Conv2d)
        )  # the patch projection's
        self.predict = nn.Linear(width, trunk.patch_size**2 * channels)

    def forward(self, encoded: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        x = self.embed(encoded)
        n, width, prefix = x.shape[0], x.shape[-1], self.num_prefix
        tokens = self.mask_token.to(x.dtype).expand(n, self.grid**2, width)
        tokens = tokens.scatter(1, keep.unsqueeze(-1).expand(-1, -1, width), x[:, prefix:])
        x = torch.cat([x[:, :prefix], tokens], dim=1) + self.pos_embedding.to(x.dtype)
        for block in self.blocks:
            x = block(x)
        return self.predict(self.norm(x)[:, prefix:])


def build_head(head_cfg, trunk: nn.Module) -> MAEDecoder:
    if not hasattr(trunk, "patch_size"):
        raise ConfigError(
            "the mae_decoder head reads a ViT's patches: set MODEL.TRUNK.NAME=vit (or timm with a VisionTransformer)"
        )
    dims, depth, heads = list(head_cfg.DIMS), head_cfg.DECODER_DEPTH, head_cfg.DECODER_HEADS
    if len(dims) != 2 or depth < 1 or heads < 1 or dims[1] % heads or dims[1] % 4:
        raise ConfigError(
            f"the mae_decoder head takes MODEL.HEAD.DIMS=[encoder width, decoder width] with the decoder "
            f"width a multiple of 4 and of DECODER_HEADS, DECODER_DEPTH >= 1 (got DIMS={dims}, "
            f"DECODER_DEPTH={depth}, DECODER_HEADS={heads})"
        )
    return MAEDecoder(dims, depth, heads, trunk)


class MAECriterion(Criterion):
    """MAE on the decoder's pixels (N, L, P*P*C) of the one crop per image, against that crop's
    patches: ``masking`` draws (keep, masked) for the crop and remembers the crop and the masked
    indices; ``forward`` scores the masked patches. The generator is this rank's and part of
    ``state_dict()``."""

    def __init__(self, mae_cfg, model_cfg=None):
        super().__init__()
        if model_cfg is None:
            raise ValueError("mae_loss needs MODEL (build it with build_method(cfg))")
        self.patch_size = _layout(model_cfg.TRUNK).patch_size
        self.mask_ratio = float(mae_cfg.mask_ratio)
        self.norm_pix_loss = bool(mae_cfg.norm_pix_loss)
        # the run's seed (set before the criterion is built) and the rank: independent masks per rank
        self.generator = torch.Generator().manual_seed(torch.initial_seed() + 7919 * comm.get_rank())
        self._pending: Optional[tuple] = None  # (images, masked indices) of the last masking()

    def masking(self, crops: Sequence[torch.Tensor]) -> Dict[str, torch.Tensor]:
        """``keep`` (N, K) for the one crop (N, C, H, W): the kept patches of each image."""
        if len(crops) != 1:
            raise ValueError(f"mae_loss takes one crop per image, got {len(crops)}")
        images = crops[0]
        patches = (images.shape[-2] // self.patch_size) * (images.shape[-1] // self.patch_size)
        keep, masked = random_keep(images.shape[0], patches, self.mask_ratio, self.generator)
        self._pending = (images, masked.to(images.device))
        return {"keep": keep.to(images.device)}

    def forward(self, model_output: torch.Tensor, num_crops: int, teacher_output=None) -> torch.Tensor:
        pending, self._pending = self._pending, None
        if pending is None:
            raise ValueError("mae_loss scores the crop masking() masked: call it before the model")
        images, masked = pending
        return mae_loss(model_output, patchify(images, self.patch_size), masked, self.norm_pix_loss)

    def get_extra_state(self):
        return {"generator": self.generator.get_state()}

    def set_extra_state(self, state) -> None:
        self.generator.set_state(state["generator"])


def _layout(trunk_cfg) -> TokenLayout:
    layout = token_layout(trunk_cfg)
    if isinstance(layout, str):
        raise ConfigError(f"LOSS.NAME=mae_loss masks a ViT's patches: {layout}")
    return layout


def vit_trunk(cfg) -> Optional[str]:
    """A method check: MAE masks a ViT's patches (the built-in ViT, or a timm VisionTransformer)
    and its decoder reads the "sequence" feature."""
    trunk = cfg.MODEL.TRUNK
    layout = token_layout(trunk)
    if isinstance(layout, str):
        return f"LOSS.NAME=mae_loss masks a ViT's patches: {layout} (now MODEL.TRUNK.NAME={trunk.NAME})"
    if "sequence" not in trunk.OUT_FEATURES:
        return (
            f"LOSS.NAME=mae_loss decodes the ViT's token sequence: add sequence to MODEL.TRUNK.OUT_FEATURES "
            f"(now {list(trunk.OUT_FEATURES)})"
        )
    return None


HEAD = Head("mae_decoder", build_head, head_keys, sized_by_trunk=True)

METHOD = Method(
    name="mae_loss",
    criterion=MAECriterion,
    head=HEAD,
    section=section,
    rules={"mask_ratio": [at_least(0.0), below(1.0)]},
    checks=(vit_trunk,),
    min_crops=1,
    max_crops=1,
)
