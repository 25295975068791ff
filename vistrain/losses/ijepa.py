"""I-JEPA (Assran et al., 2023): its multi-block masks and its loss, as the authors' ``MaskCollator``
(facebookresearch/ijepa ``src/masks/multiblock.py``) and ``forward_target`` / ``loss_fn``
(``src/train.py``).

Masks, per step: one target block size and one context block size for the whole batch, each from
one uniform draw ``r`` (``scale = lo + r (hi - lo)``, ``aspect = lo + r (hi - lo)`` with the same
``r``, ``int(L scale)`` patches, ``h = round(sqrt(n aspect))``, ``w = round(sqrt(n / aspect))``,
each lowered below the grid's side); then per image ``num_targets`` target blocks at uniform
positions (``randint(0, side - h)``: the last row and column are never a block's top-left, as the
authors'), and one context block with every target block removed; a block is redrawn until it
holds more than ``min_keep`` patches (after 20 failed draws the context drops the constraint of the
last target, then the next, ...). Each image's indices are in raster order and cut to the batch's
smallest count, so the batch stacks. The sizes come from a generator every rank seeds alike (the
authors' per-step seed), the positions from the rank's own.

Loss: the smooth L1 loss between the predictor's outputs and the target encoder's outputs,
layer-normalised over the features (no affine), at the target blocks' patches, averaged over every
value. Every rank's target blocks hold the same number of patches, so DDP's mean over ranks is the
mean over the global batch.
"""

import math
from typing import List, Optional, Tuple

import torch
import torch.nn.functional as F

_TIMEOUT = 20  # the authors' failed draws before a constraint is dropped
_MAX_DRAWS = 1000  # a target block that can never hold more than min_keep patches


def block_size(
    grid: Tuple[int, int], scale: Tuple[float, float], aspect: Tuple[float, float], r: float
) -> Tuple[int, int]:
    """(h, w) of a block for the uniform draw ``r`` (the authors' ``_sample_block_size``)."""
    height, width = grid
    keep = int(height * width * (scale[0] + r * (scale[1] - scale[0])))
    ratio = aspect[0] + r * (aspect[1] - aspect[0])
    h, w = int(round(math.sqrt(keep * ratio))), int(round(math.sqrt(keep / ratio)))
    return min(h, height - 1), min(w, width - 1)


def _place(
    size: Tuple[int, int],
    grid: Tuple[int, int],
    min_keep: int,
    generator: Optional[torch.Generator],
    allowed: Optional[List[torch.Tensor]] = None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """(the block's patch indices (K,) in raster order, its complement (h, w) int32), the block
    restricted to ``allowed`` (the authors' ``_sample_block_mask``)."""
    (h, w), (height, width) = size, grid
    tries, timeout, draws = 0, _TIMEOUT, 0
    while True:
        top = int(torch.randint(0, height - h, (1,), generator=generator))
        left = int(torch.randint(0, width - w, (1,), generator=generator))
        mask = torch.zeros(height, width, dtype=torch.int32)
        mask[top : top + h, left : left + w] = 1
        for region in (allowed or [])[: max(len(allowed or []) - tries, 0)]:
            mask *= region
        indices = mask.flatten().nonzero().squeeze(1)
        if len(indices) > min_keep:
            break
        draws, timeout = draws + 1, timeout - 1
        if timeout == 0:
            tries, timeout = tries + 1, _TIMEOUT
        if allowed is None and draws >= _MAX_DRAWS:
            raise ValueError(
                f"a {h}x{w} block never holds more than min_keep={min_keep} patches: lower min_keep"
            )
    complement = torch.ones(height, width, dtype=torch.int32)
    complement[top : top + h, left : left + w] = 0
    return indices, complement


def multiblock_masks(
    batch: int,
    grid: Tuple[int, int],
    size_generator: Optional[torch.Generator],
    generator: Optional[torch.Generator],
    num_targets: int = 4,
    target_scale: Tuple[float, float] = (0.15, 0.2),
    target_aspect: Tuple[float, float] = (0.75, 1.5),
    context_scale: Tuple[float, float] = (0.85, 1.0),
    min_keep: int = 4,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """(context (N, Kc), targets (T, N, Kt)) int64 patch indices of a batch (module docstring):
    the context block's patches outside every target block, and each target block's patches, in
    raster order of the (h, w) ``grid``, cut to the batch's smallest counts. ``size_generator``
    draws the two block sizes (target first), ``generator`` the positions."""
    target_size = block_size(
        grid, target_scale, target_aspect, float(torch.rand(1, generator=size_generator))
    )
    context_size = block_size(grid, context_scale, (1.0, 1.0), float(torch.rand(1, generator=size_generator)))
    contexts, targets = [], []
    for _ in range(batch):
        blocks, complements = [], []
        for _ in range(num_targets):
            indices, complement = _place(target_size, grid, min_keep, generator)
            blocks.append(indices)
            complements.append(complement)
        targets.append(blocks)
        contexts.append(_place(context_size, grid, min_keep, generator, complements)[0])
    kt = min(len(b) for blocks in targets for b in blocks)
    kc = min(len(c) for c in contexts)
    context = torch.stack([c[:kc] for c in contexts])
    target = torch.stack([torch.stack([blocks[t][:kt] for blocks in targets]) for t in range(num_targets)])
    return context, target


def ijepa_loss(predicted: torch.Tensor, features: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """I-JEPA's loss.

    Args:
        predicted: (T N, Kt, D) the predictor's outputs, target block t of image n in row t N + n.
        features: (N, L, D) the target encoder's patch tokens (after its final norm).
        targets: (T, N, Kt) int64 the target blocks' patch indices.

    Returns ``smooth_l1(predicted, gather(layer_norm(features), targets))``, the mean over every
    value (beta 1), in fp32.
    """
    features = F.layer_norm(features.float(), (features.shape[-1],))
    width = features.shape[-1]
    wanted = torch.cat([features.gather(1, block.unsqueeze(-1).expand(-1, -1, width)) for block in targets])
    return F.smooth_l1_loss(predicted.float(), wanted)
