"""Token masks for masked-image modelling, and the patch layout of the pixel targets.

Pure functions on tensors. The method draws a mask per sample from the run's RNG (``generator``
None: torch's default generator, which checkpoints save and restore) and hands it to the ViT trunk
(``ViTTrunk.forward(x, keep=..., mask=...)``):

* MAE (He et al., 2022) keeps a random subset of the patches and drops the others from the
  encoder's sequence: :func:`random_keep` gives per sample the kept and the masked patch indices,
  "random sampling ... by argsort of noise" (MAE's ``random_masking``);
* iBOT / DINOv2 replace masked patch embeddings by a learned mask token: :func:`random_mask`
  (per-sample uniform) or :func:`block_mask` (BEiT's blockwise masking: rectangles of random
  area and aspect until the wanted count is reached) give a boolean (N, L) mask;
  :func:`ibot_masks` draws a batch's as DINOv2 does (a share of the images, ratios from a range).

Patch index l is row ``l // w``, column ``l % w`` of the (h, w) grid, as ``conv_proj`` followed by
``flatten(2)`` orders tokens; :func:`patchify` orders the pixel targets the same way.
"""

import math
from typing import Optional, Tuple

import torch


def random_keep(
    batch: int, num_patches: int, mask_ratio: float, generator: Optional[torch.Generator] = None, device=None
) -> Tuple[torch.Tensor, torch.Tensor]:
    """(keep (N, K), masked (N, L - K)) patch indices per sample, K = int(L (1 - mask_ratio)) as
    MAE's ``len_keep`` (at least 1); each sample's L indices are a uniform random permutation
    (argsort of U(0, 1) noise), the kept ones first."""
    if not 0.0 <= mask_ratio < 1.0:
        raise ValueError(f"mask_ratio must be in [0, 1), got {mask_ratio}")
    num_keep = max(1, int(num_patches * (1 - mask_ratio)))
    noise = torch.rand(batch, num_patches, generator=generator, device=device)
    order = noise.argsort(dim=1)
    return order[:, :num_keep], order[:, num_keep:]


def random_mask(
    batch: int, num_patches: int, mask_ratio: float, generator: Optional[torch.Generator] = None, device=None
) -> torch.Tensor:
    """Boolean (N, L): True for the patches :func:`random_keep` masks (L - int(L (1 - ratio)))."""
    _, masked = random_keep(batch, num_patches, mask_ratio, generator, device)
    mask = torch.zeros(batch, num_patches, dtype=torch.bool, device=masked.device)
    return mask.scatter_(1, masked, True)


def block_mask(
    grid: Tuple[int, int],
    num_masked: int,
    generator: Optional[torch.Generator] = None,
    min_block: int = 4,
    aspect: Tuple[float, float] = (0.3, 1 / 0.3),
    max_attempts: int = 10,
) -> torch.Tensor:
    """Boolean (h, w) mask of one image with ``num_masked`` patches masked in rectangles (BEiT's
    blockwise masking, as dinov2's ``MaskingGenerator``): each rectangle has an area drawn
    uniformly from [min_block, still missing] and a log-uniform aspect ratio; a rectangle that
    would add nothing is redrawn (``max_attempts``); patches still missing are then masked
    uniformly at random, so the count is exact."""
    h, w = grid
    if not 0 <= num_masked <= h * w:
        raise ValueError(f"num_masked must be in [0, {h * w}] for a {h}x{w} grid, got {num_masked}")
    mask = torch.zeros(h, w, dtype=torch.bool)
    log_lo, log_hi = math.log(aspect[0]), math.log(aspect[1])
    attempts = 0
    while int(mask.sum()) < num_masked and attempts < max_attempts:
        missing = num_masked - int(mask.sum())
        area = _uniform(generator, min(min_block, missing), missing)
        ratio = math.exp(_uniform(generator, log_lo, log_hi))
        bh = min(h, max(1, round(math.sqrt(area * ratio))))
        bw = min(w, max(1, round(math.sqrt(area / ratio))))
        top = int(torch.randint(0, h - bh + 1, (1,), generator=generator))
        left = int(torch.randint(0, w - bw + 1, (1,), generator=generator))
        block = mask[top : top + bh, left : left + bw]
        added = int((~block).sum())
        if 0 < added <= missing:
            block.fill_(True)
            attempts = 0
        else:
            attempts += 1
    rest = (~mask).flatten().nonzero().squeeze(1)
    missing = num_masked - int(mask.sum())
    if missing > 0:
        pick = rest[torch.randperm(rest.numel(), generator=generator)[:missing]]
        mask.view(-1)[pick] = True
    return mask


def ibot_masks(
    batch: int,
    grid: Tuple[int, int],
    ratio_range: Tuple[float, float],
    sample_probability: float,
    generator: Optional[torch.Generator] = None,
) -> torch.Tensor:
    """Boolean (batch, h * w) masks of a batch of images, as DINOv2's collate: a share
    ``sample_probability`` of the images is masked (at least one), the others not; the masked
    ones get stratified ratios (image i of n a ratio uniform in the i-th of n equal slices of
    ``ratio_range``) of their L patches, at least one, in :func:`block_mask` rectangles; the
    images' order is then shuffled."""
    low, high = ratio_range
    if not 0.0 <= low <= high < 1.0 or not 0.0 < sample_probability <= 1.0:
        raise ValueError(
            f"need 0 <= ratio_range[0] <= ratio_range[1] < 1 and 0 < sample_probability <= 1, got "
            f"{list(ratio_range)} and {sample_probability}"
        )
    h, w = grid
    num_masked = min(batch, max(1, int(batch * sample_probability)))
    step = (high - low) / num_masked
    masks = torch.zeros(batch, h * w, dtype=torch.bool)
    for i in range(num_masked):
        ratio = _uniform(generator, low + i * step, low + (i + 1) * step)
        masks[i] = block_mask(grid, max(1, int(h * w * ratio)), generator).flatten()
    return masks[torch.randperm(batch, generator=generator)]


def ibot_masked_bound(
    batch: int, num_patches: int, ratio_range: Tuple[float, float], sample_probability: float
) -> int:
    """The most patches :func:`ibot_masks` can mask in a batch (DINOv2's collate ``upperbound``):
    image i of the n masked ones at most ``int(L * (low + (i + 1) (high - low) / n))``, at least 1."""
    low, high = ratio_range
    num_masked = min(batch, max(1, int(batch * sample_probability)))
    step = (high - low) / num_masked
    return sum(max(1, int(num_patches * (low + (i + 1) * step))) for i in range(num_masked))


def mask_to(mask: torch.Tensor, device) -> torch.Tensor:
    """A boolean mask on ``device``, but kept where it is when ``device`` is meta: the mask's values
    decide the shape of what it selects (``tokens[mask]``: (M, D), M its True count), so a forward
    on the meta device (the memory planner's trace) indexes with the real mask."""
    return mask if torch.device(device).type == "meta" else mask.to(device)


def _uniform(generator: Optional[torch.Generator], low: float, high: float) -> float:
    return float(low + (high - low) * torch.rand((), generator=generator))


def patchify(images: torch.Tensor, patch_size: int) -> torch.Tensor:
    """(N, C, H, W) -> (N, L, P * P * C), L = (H / P) (W / P) in token order; each patch's pixels
    row by row, channels last (MAE's and lightly's layout)."""
    n, c, height, width = images.shape
    p = patch_size
    if height % p or width % p:
        raise ValueError(f"patch size {p} must divide the image sides, got {height}x{width}")
    h, w = height // p, width // p
    x = images.reshape(n, c, h, p, w, p).permute(0, 2, 4, 3, 5, 1)  # (N, h, w, P, P, C)
    return x.reshape(n, h * w, p * p * c)


def unpatchify(
    patches: torch.Tensor, patch_size: int, grid: Tuple[int, int], channels: int = 3
) -> torch.Tensor:
    """Inverse of :func:`patchify`: (N, h * w, P * P * C) -> (N, C, h P, w P)."""
    n = patches.shape[0]
    (h, w), p = grid, patch_size
    x = patches.reshape(n, h, w, p, p, channels).permute(0, 5, 1, 3, 2, 4)
    return x.reshape(n, channels, h * p, w * p)


def sincos_position_embedding(grid: Tuple[int, int], width: int) -> torch.Tensor:
    """Fixed 2-D sin-cos position embeddings (MAE, MoCo v3): (h * w, D), D divisible by 4.

    The first half of the channels encodes the column, the second the row (the order of MAE's
    ``get_2d_sincos_pos_embed``, whose checkpoints then load as they are); each half is
    ``[sin(pos * omega_k), cos(pos * omega_k)]`` with ``omega_k = 1 / 10000^(k / (D/4))``,
    k = 0 .. D/4 - 1."""
    if width % 4:
        raise ValueError(f"sin-cos position embeddings need a width divisible by 4, got {width}")
    h, w = grid
    # on the CPU whatever the default device (a model built on the meta device keeps the table)
    omega = 1.0 / 10000 ** (torch.arange(width // 4, dtype=torch.float64, device="cpu") / (width // 4))
    rows, cols = torch.meshgrid(
        torch.arange(h, dtype=torch.float64, device="cpu"),
        torch.arange(w, dtype=torch.float64, device="cpu"),
        indexing="ij",
    )

    def encode(pos: torch.Tensor) -> torch.Tensor:
        angles = pos.reshape(-1, 1) * omega
        return torch.cat([angles.sin(), angles.cos()], dim=1)

    return torch.cat([encode(cols), encode(rows)], dim=1).float()
