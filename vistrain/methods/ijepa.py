"""I-JEPA (Assran et al., 2023): "from a single context block, predict the representations of
various target blocks in the same image". The context encoder (the trunk, a ViT) encodes the
context block's patches only (``keep=``); a narrow ViT predictor (``ijepa_predictor``) takes the
encoded context and, for each target block, mask tokens carrying the target patches' positions,
and predicts the target encoder's layer-normalised outputs at those patches (smooth L1,
``vistrain/losses/ijepa.py``, with the multi-block masks). The target encoder is the momentum
teacher (an EMA of the context encoder, cosine from ``momentum_teacher`` to 1) and sees every
patch. One view per image. As the authors' code (facebookresearch/ijepa: ``MaskCollator``,
``VisionTransformerPredictor``, ``forward_target``, ``loss_fn``).

The target block sizes are drawn from the run's seed and the iteration (the same on every rank and
after a resume, as the authors' per-step seed), the positions from the criterion's own generator,
seeded from the run's seed and the rank and saved in every checkpoint (as MAE's masks).
"""

import functools
from typing import Dict, Optional, Sequence

import torch
from fvcore.common.config import CfgNode
from torch import nn
from torchvision.models.vision_transformer import EncoderBlock

from vistrain.config.checks import at_least
from vistrain.config.errors import ConfigError
from vistrain.distributed import comm
from vistrain.losses.ijepa import block_size, ijepa_loss, multiblock_masks
from vistrain.methods.base import Criterion, Head, Method
from vistrain.models.masking import sincos_position_embedding
from vistrain.models.trunks import token_layout
from vistrain.models.trunks.vit import LAYER_NORM_EPS, LayerNorm32


def section() -> CfgNode:
    """LOSS.ijepa_loss (the defaults: the paper's ViT-H/14 recipe)."""
    c = CfgNode()
    c.momentum_teacher = 0.996  # m0 of the target encoder's EMA: cosine from m0 to 1 (I-JEPA: linear)
    c.num_targets = 4  # target blocks per image
    c.target_scale = [0.15, 0.2]  # range of a target block's share of the patches
    c.target_aspect = [0.75, 1.5]  # range of a target block's aspect ratio (height / width)
    c.context_scale = [0.85, 1.0]  # range of the context block's share, before the targets are removed
    c.min_keep = 10  # a block holds more than this many patches (I-JEPA ViT-H/14: 10)
    return c


def head_keys() -> CfgNode:
    """MODEL.HEAD keys of the ijepa_predictor head (its width is DIMS[1]; DIMS[0] the encoder's)."""
    c = CfgNode()
    c.PREDICTOR_DEPTH = 12  # ijepa_predictor: transformer blocks (I-JEPA ViT-H/14: 12 at width 384)
    c.PREDICTOR_HEADS = 16  # ijepa_predictor: attention heads, dividing DIMS[1] (I-JEPA: the encoder's)
    return c


class IJEPAPredictor(nn.Module):
    """I-JEPA's predictor. ``forward(sequence, keep, targets)``: sequence (N, prefix + Kc, D) the
    context encoder's tokens of the kept patches ``keep`` (N, Kc); targets (T, N, Kt) the target
    blocks' patches -> (T N, Kt, D), target block t of image n in row t N + n: the context
    embedded to the predictor's width plus its fixed 2-D sin-cos positions, repeated per block,
    followed by one mask token per target patch plus its position; transformer blocks, a norm,
    the target tokens projected back to D. ``forward(sequence)`` (the target encoder's pass,
    every patch): the patch tokens (N, L, D) as they are (the loss normalises them).
    """

    in_feature = "sequence"

    def __init__(self, dims: Sequence[int], depth: int, heads: int, trunk: nn.Module):
        super().__init__()
        in_width, width = int(dims[0]), int(dims[-1])
        self.num_prefix = trunk.num_prefix
        self.embed = nn.Linear(in_width, width)
        self.mask_token = nn.Parameter(torch.zeros(1, 1, width))
        nn.init.trunc_normal_(self.mask_token, std=0.02)
        table = sincos_position_embedding((trunk.grid, trunk.grid), width)
        self.register_buffer("pos_embedding", torch.tensor(table.tolist()))  # a factory a meta build replays
        norm = functools.partial(LayerNorm32, eps=LAYER_NORM_EPS)
        self.blocks = nn.ModuleList(
            [EncoderBlock(heads, width, 4 * width, 0.0, 0.0, norm) for _ in range(depth)]
        )
        self.norm = norm(width)
        self.project = nn.Linear(width, in_width)

    def forward(
        self,
        sequence: torch.Tensor,
        keep: Optional[torch.Tensor] = None,
        targets: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        patches = sequence[:, self.num_prefix :]
        if keep is None and targets is None:
            return patches
        if keep is None or targets is None:
            raise ValueError("the ijepa_predictor takes keep= and targets= together")
        pos = self.pos_embedding.to(patches.dtype)
        context = self.embed(patches) + pos[keep]
        t, n, k = targets.shape
        queries = self.mask_token.to(patches.dtype) + pos[targets.reshape(t * n, k)]
        x = torch.cat([context.repeat(t, 1, 1), queries], dim=1)
        for block in self.blocks:
            x = block(x)
        return self.project(self.norm(x)[:, context.shape[1] :])


def build_head(head_cfg, trunk: nn.Module) -> IJEPAPredictor:
    if not hasattr(trunk, "patch_size"):
        raise ConfigError(
            "the ijepa_predictor head reads a ViT's patches: set MODEL.TRUNK.NAME=vit (or timm with a VisionTransformer)"
        )
    dims, depth, heads = list(head_cfg.DIMS), head_cfg.PREDICTOR_DEPTH, head_cfg.PREDICTOR_HEADS
    if len(dims) != 2 or depth < 1 or heads < 1 or dims[1] % heads or dims[1] % 4:
        raise ConfigError(
            f"the ijepa_predictor head takes MODEL.HEAD.DIMS=[encoder width, predictor width] with the "
            f"predictor width a multiple of 4 and of PREDICTOR_HEADS, PREDICTOR_DEPTH >= 1 (got DIMS={dims}, "
            f"PREDICTOR_DEPTH={depth}, PREDICTOR_HEADS={heads})"
        )
    return IJEPAPredictor(dims, depth, heads, trunk)


class IJEPACriterion(Criterion):
    """I-JEPA on the predictor's (T N, Kt, D) outputs and the target encoder's (N, L, D) patch
    tokens of the one crop per image: ``masking`` draws the context (``keep``) and the target
    blocks (``targets``, for the predictor) and remembers the targets."""

    def __init__(self, ijepa_cfg, model_cfg=None):
        super().__init__()
        if model_cfg is None:
            raise ValueError("ijepa_loss needs MODEL (build it with build_method(cfg))")
        layout = token_layout(model_cfg.TRUNK)
        if isinstance(layout, str):
            raise ConfigError(f"LOSS.NAME=ijepa_loss masks a ViT's patches: {layout}")
        self.patch_size = layout.patch_size
        self.teacher_momentum = float(ijepa_cfg.momentum_teacher)
        self.blocks = dict(
            num_targets=int(ijepa_cfg.num_targets),
            target_scale=tuple(ijepa_cfg.target_scale),
            target_aspect=tuple(ijepa_cfg.target_aspect),
            context_scale=tuple(ijepa_cfg.context_scale),
            min_keep=int(ijepa_cfg.min_keep),
        )
        # the run's seed (set before the criterion is built) and the rank: independent positions per rank
        self.generator = torch.Generator().manual_seed(torch.initial_seed() + 7919 * comm.get_rank())
        self.size_generator = torch.Generator().manual_seed(0)
        self._targets: Optional[torch.Tensor] = None  # (T, N, Kt) of the last masking()

    def set_iteration(self, iteration: int, seed: int) -> None:
        self.size_generator.manual_seed(1_000_003 * seed + iteration)

    def masking(self, crops: Sequence[torch.Tensor]) -> Dict[str, torch.Tensor]:
        """``keep`` (N, Kc) and ``targets`` (T, N, Kt) for the one crop (N, 3, H, W)."""
        if len(crops) != 1:
            raise ValueError(f"ijepa_loss takes one crop per image, got {len(crops)}")
        images, p = crops[0], self.patch_size
        grid = (images.shape[-2] // p, images.shape[-1] // p)
        context, targets = multiblock_masks(
            images.shape[0], grid, self.size_generator, self.generator, **self.blocks
        )
        self._targets = targets
        return {"keep": context.to(images.device), "targets": targets.to(images.device)}

    def forward(self, model_output: torch.Tensor, num_crops: int, teacher_output=None) -> torch.Tensor:
        targets, self._targets = self._targets, None
        if targets is None or teacher_output is None:
            raise ValueError("ijepa_loss scores the blocks masking() drew against the teacher's output")
        return ijepa_loss(model_output, teacher_output, targets.to(model_output.device))

    def get_extra_state(self):
        return {"generator": self.generator.get_state()}

    def set_extra_state(self, state) -> None:
        self.generator.set_state(state["generator"])


def vit_blocks(cfg) -> Optional[str]:
    """A method check: I-JEPA encodes a ViT's patches, its predictor reads the "sequence" feature,
    and every target block it can draw holds more than min_keep patches."""
    trunk, blocks = cfg.MODEL.TRUNK, cfg.LOSS.ijepa_loss
    layout = token_layout(trunk)
    if isinstance(layout, str):
        return f"LOSS.NAME=ijepa_loss masks a ViT's patches: {layout} (now MODEL.TRUNK.NAME={trunk.NAME})"
    if "sequence" not in trunk.OUT_FEATURES:
        return (
            f"LOSS.NAME=ijepa_loss predicts the ViT's token sequence: add sequence to MODEL.TRUNK.OUT_FEATURES "
            f"(now {list(trunk.OUT_FEATURES)})"
        )
    for size in cfg.DATA.TRAIN.TRANSFORMS.SIZE_CROPS:
        grid = (size // layout.patch_size,) * 2
        smallest = min(
            h * w
            for h, w in (
                block_size(grid, blocks.target_scale, blocks.target_aspect, r / 100) for r in range(101)
            )
        )
        if smallest <= blocks.min_keep:
            return (
                f"LOSS.ijepa_loss: a target block of {smallest} patches (of the {grid[0]}x{grid[1]} grid) never "
                f"holds more than min_keep={blocks.min_keep}: lower min_keep or raise target_scale"
            )
    return None


HEAD = Head("ijepa_predictor", build_head, head_keys, sized_by_trunk=True)

METHOD = Method(
    name="ijepa_loss",
    criterion=IJEPACriterion,
    head=HEAD,
    section=section,
    rules={"num_targets": [at_least(1)], "min_keep": [at_least(0)], "momentum_teacher": [at_least(0.0)]},
    checks=(vit_blocks,),
    teacher=True,
    min_crops=1,
    max_crops=1,
)
