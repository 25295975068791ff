"""SimMIM (Xie et al., 2022): its random masks of large square units and its L1 loss on the
masked pixels, as the authors' ``MaskGenerator`` and ``SimMIM.forward`` (microsoft/SimMIM).

Masks: the image is cut into units of ``mask_patch_size`` pixels (32 in the paper, for 192 px
images and the ViT's 16 px patches); ``ceil(units * mask_ratio)`` units drawn uniformly without
replacement are masked, and every model patch inside a masked unit is masked. Each image masks
exactly the same number of patches, so the mean over a rank's masked pixels, averaged over ranks
by DDP or the sharded engine, is the mean over the global batch (up to the formula's 1e-5).
"""

import math
from typing import Optional, Tuple

import torch


def simmim_masks(
    batch: int,
    grid: Tuple[int, int],
    unit: int,
    mask_ratio: float,
    generator: Optional[torch.Generator] = None,
) -> torch.Tensor:
    """Boolean (batch, h * w): True for the masked model patches of each image.

    ``grid`` (h, w): the model's patches per side; ``unit``: model patches per side of a mask unit
    (mask_patch_size / model_patch_size), dividing h and w. Per image the (h / unit) (w / unit)
    units are permuted (``torch.randperm``, the authors' ``np.random.permutation``) and the first
    ``ceil(units * mask_ratio)`` masked; each unit covers ``unit x unit`` patches.
    """
    h, w = grid
    if unit < 1 or h % unit or w % unit:
        raise ValueError(f"a mask unit of {unit} patches must divide the {h}x{w} patch grid")
    if not 0.0 <= mask_ratio < 1.0:
        raise ValueError(f"mask_ratio must be in [0, 1), got {mask_ratio}")
    rows, cols = h // unit, w // unit
    count = int(math.ceil(rows * cols * mask_ratio))
    units = torch.zeros(batch, rows * cols, dtype=torch.bool)
    for image in range(batch):
        units[image, torch.randperm(rows * cols, generator=generator)[:count]] = True
    units = units.reshape(batch, rows, cols)
    return units.repeat_interleave(unit, dim=1).repeat_interleave(unit, dim=2).reshape(batch, h * w)


def simmim_loss(
    images: torch.Tensor, reconstructed: torch.Tensor, mask: torch.Tensor, patch_size: int
) -> torch.Tensor:
    """SimMIM's loss: the L1 distance on masked pixels, "averaged over masked pixels / in_chans".

    Args:
        images: (N, C, H, W) the crops the encoder saw (before masking).
        reconstructed: (N, C, H, W) the linear decoder's pixels.
        mask: (N, h * w) bool, the masked patches in token order (h = H / P, w = W / P).
        patch_size: P, the model's patch side in pixels.

    Returns ``sum(|x - x_rec| * m) / (sum(m) + 1e-5) / C`` in fp32, m the (N, 1, H, W) pixel mask
    (each patch's flag repeated over its P x P pixels), summed over channels in the numerator only.
    """
    n, channels, height, width = images.shape
    p = patch_size
    pixels = mask.reshape(n, height // p, width // p).float()
    pixels = pixels.repeat_interleave(p, dim=1).repeat_interleave(p, dim=2).unsqueeze(1)
    distance = (images.float() - reconstructed.float()).abs()
    return (distance * pixels).sum() / (pixels.sum() + 1e-5) / channels
