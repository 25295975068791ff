"""The operations of ``transforms.MultiCropTransform``, each on M views at once.

Images are float32 in [0, 1] of shape (M, C, H, W), C = 1 (grayscale), 3 (RGB) or any other
number of channels (bands: geometry, brightness, contrast and blur only); every random
parameter is a tensor with one entry per view (M,), so one call does the work that torchvision's
transforms do one PIL image at a time. Each function follows the torchvision (or PIL) op named in
its docstring; they differ only in floating point (8-bit images are resized in 8 bits, as PIL does;
no rounding to 8 bits between the later steps) and where a docstring says so. The colour operations work in place (they return their input, changed): on a
CPU a fresh tensor costs more than the arithmetic (its pages are mapped and zeroed when first
written). Every tensor an operation makes is on its input's device.
"""

import math
from typing import Callable, Sequence

import torch
import torch.nn.functional as F

_LUMA = (0.299, 0.587, 0.114)  # ITU-R 601-2, as PIL's convert("L") (torchvision's tensor op: 0.2989 R)
_TINY = torch.finfo(torch.float32).tiny


def _at(values: torch.Tensor) -> torch.Tensor:
    """(M,) -> (M, 1, 1, 1), to scale images view by view."""
    return values.view(-1, 1, 1, 1)


def apply_where(
    images: torch.Tensor, mask: torch.Tensor, op: Callable, *factors: torch.Tensor
) -> torch.Tensor:
    """``op(images[i], factors[i]...)`` for the views where ``mask`` (M,) bool is True, in place;
    the others are left as they are (``RandomApply``). ``op`` may change its input."""
    return apply_to(images, mask.nonzero().squeeze(1).tolist(), op, *factors)


def apply_to(
    images: torch.Tensor, chosen: Sequence[int], op: Callable, *factors: torch.Tensor
) -> torch.Tensor:
    """``op(images[i], factors[i]...)`` for the views ``chosen`` (ascending indices), in place."""
    if chosen and chosen[-1] - chosen[0] + 1 == len(chosen):  # a run of views: no gather and scatter
        run = slice(chosen[0], chosen[-1] + 1)
        part = images[run]
        out = op(part, *(f[run] for f in factors))
        if out is not part:
            part.copy_(out)
    elif chosen:
        index = torch.tensor(chosen, device=images.device)
        images[index] = op(images[index], *(f[index] for f in factors))
    return images


# ------------------------------------------------------------------------------------- geometry
def crop_boxes(
    u_area: torch.Tensor,
    u_ratio: torch.Tensor,
    u_place: torch.Tensor,
    heights: torch.Tensor,
    widths: torch.Tensor,
    scale: Sequence[float],
    ratio: Sequence[float] = (3 / 4, 4 / 3),
) -> torch.Tensor:
    """``RandomResizedCrop.get_params`` for M views: (M, 4) long boxes (top, left, height, width).

    Each of the attempts (columns of ``u_area``, ``u_ratio`` (M, A), uniforms in [0, 1)) proposes
    area ``H W U(scale)`` and aspect ``exp(U(log ratio))``, rounded to whole pixels; the first
    that fits is placed uniformly (``u_place`` (M, 2): top, left). When none fits: the whole image,
    cropped to the nearest aspect in ``ratio``, centred. ``heights``, ``widths``: (M,) of the images.
    """
    h_img, w_img = heights.double()[:, None], widths.double()[:, None]
    target = h_img * w_img * (scale[0] + (scale[1] - scale[0]) * u_area.double())
    lo, hi = math.log(ratio[0]), math.log(ratio[1])
    aspect = torch.exp(lo + (hi - lo) * u_ratio.double())
    w, h = torch.sqrt(target * aspect).round(), torch.sqrt(target / aspect).round()
    fits = (w > 0) & (w <= w_img) & (h > 0) & (h <= h_img)
    first = fits.int().argmax(1, keepdim=True)  # the first attempt that fits (0 if none)
    found = fits.any(1)
    w, h = w.gather(1, first).squeeze(1), h.gather(1, first).squeeze(1)
    h_img, w_img = h_img.squeeze(1), w_img.squeeze(1)
    in_ratio = w_img / h_img
    narrow, wide = in_ratio < min(ratio), in_ratio > max(ratio)
    w_all = torch.where(wide, (h_img * max(ratio)).round(), w_img)
    h_all = torch.where(narrow, (w_img / min(ratio)).round(), h_img)
    w, h = torch.where(found, w, w_all), torch.where(found, h, h_all)
    top = torch.where(found, torch.floor(u_place[:, 0] * (h_img - h + 1)), torch.div(h_img - h, 2).floor())
    left = torch.where(found, torch.floor(u_place[:, 1] * (w_img - w + 1)), torch.div(w_img - w, 2).floor())
    return torch.stack([top, left, h, w], 1).long()


def resizable(pixels: torch.Tensor) -> torch.Tensor:
    """(C, H, W) as it is, or, 8-bit RGB on a CPU, with its channels last in memory (a copy unless
    they are): torch's uint8 resize runs on such pixels without converting each crop."""
    if pixels.dtype != torch.uint8 or pixels.device.type != "cpu" or pixels.shape[0] != 3:
        return pixels
    return pixels.permute(1, 2, 0).contiguous().permute(2, 0, 1)


def resized_crops(
    images,
    source: torch.Tensor,
    boxes: torch.Tensor,
    size: int,
    out: torch.Tensor = None,
    rows: Sequence[int] = (),
) -> torch.Tensor:
    """Crop ``boxes`` (M, 4) (top, left, height, width) of ``images[source]`` (images: (N, C, H, W),
    or N tensors (C, H_n, W_n); source (M,) long) and resize each to (size, size): float32 (M, C,
    size, size), or written to ``out[rows[m]]`` when given. As ``RandomResizedCrop``'s (PIL's)
    bilinear resize with antialiasing (torch's ``antialias=True``): output pixel o, centred at
    c = (o + 1/2) length / size in the crop, averages the crop's pixels x with weights
    max(0, 1 - |x + 1/2 - c| / f), f = max(length / size, 1), normalised to sum 1, along rows then
    columns. uint8 images are resized in 8 bits, as PIL resizes them (each crop rounded to whole
    levels: torch's fixed-point uint8 kernel on a CPU, float rounded to the nearest level on other
    devices, whose kernels have no uint8), then read as value / 255."""
    if out is None:
        out = torch.empty(len(boxes), images[0].shape[0], size, size, device=images[0].device)
        rows = range(len(boxes))
    for row, n, (top, left, height, width) in zip(rows, source.tolist(), boxes.tolist()):
        crop = images[n][:, top : top + height, left : left + width].unsqueeze(0)
        if crop.dtype != torch.uint8:
            out[row] = F.interpolate(crop, (size, size), mode="bilinear", antialias=True)[0]
        elif crop.device.type == "cpu":
            resized = F.interpolate(crop, (size, size), mode="bilinear", antialias=True)[0]
            torch.div(resized, 255, out=out[row])
        else:
            resized = F.interpolate(crop.float(), (size, size), mode="bilinear", antialias=True)[0]
            torch.div(resized.round_().clamp_(0, 255), 255, out=out[row])
    return out


def affine_inverse(
    angle: torch.Tensor, tx: torch.Tensor, ty: torch.Tensor, scale: torch.Tensor, shear: torch.Tensor
) -> torch.Tensor:
    """(M, 2, 3) maps from output to input pixel coordinates, origin at the image centre, of
    ``F.affine(angle, (tx, ty), scale, shear=(shear, 0))`` (degrees; torchvision's
    ``_get_inverse_affine_matrix`` with centre 0): the inverse of T(t) R(angle) Sh(shear) S(scale)."""
    rot, sx = torch.deg2rad(angle.double()), torch.deg2rad(shear.double())
    a, c = torch.cos(rot), torch.sin(rot)
    b, d = -a * torch.tan(sx) - c, -c * torch.tan(sx) + a
    s = scale.double()
    m00, m01, m10, m11 = d / s, -b / s, -c / s, a / s
    m02 = -(m00 * tx + m01 * ty)
    m12 = -(m10 * tx + m11 * ty)
    return torch.stack([m00, m01, m02, m10, m11, m12], 1).view(-1, 2, 3).float()


def _pixel_centres(size: int, device: torch.device) -> torch.Tensor:
    """(size,) centres of the pixels in grid_sample units (-1, 1), align_corners=False."""
    return torch.linspace((1 - size) / size, (size - 1) / size, size, device=device)


def warp_affine(images: torch.Tensor, inverse: torch.Tensor) -> torch.Tensor:
    """``F.affine`` of each view (M, C, H, W) by its ``inverse`` (M, 2, 3) from ``affine_inverse``:
    bilinear, uncovered pixels 0 (black)."""
    _, _, h, w = images.shape
    half = inverse.new_tensor([w / 2, h / 2])
    xs, ys = _pixel_centres(w, images.device) * half[0], _pixel_centres(h, images.device) * half[1]
    m = (inverse / half.view(1, 2, 1)).unsqueeze(-1).unsqueeze(-1)  # input coordinates in grid units
    grid_x = m[:, 0, 0] * xs + m[:, 0, 1] * ys.view(h, 1) + m[:, 0, 2]
    grid_y = m[:, 1, 0] * xs + m[:, 1, 1] * ys.view(h, 1) + m[:, 1, 2]
    grid = torch.stack([grid_x, grid_y], -1)  # (M, H, W, 2)
    return F.grid_sample(images, grid, mode="bilinear", padding_mode="zeros", align_corners=False)


def _gaussian_kernels(sigma: torch.Tensor, radius: int) -> torch.Tensor:
    """(M, 2 radius + 1) normalised Gaussian weights exp(-x^2 / 2 sigma^2), x = -radius..radius."""
    x = torch.arange(-radius, radius + 1, dtype=torch.float32, device=sigma.device)
    weights = torch.exp(-0.5 * (x / sigma.float().view(-1, 1)) ** 2)
    return weights / weights.sum(1, keepdim=True)


def _blur_lines(images: torch.Tensor, kernels: torch.Tensor, dim: int, mode: str) -> torch.Tensor:
    """Convolve each view (M, C, H, W) along ``dim`` (-1: x, -2: y) with its kernel (M, K), K odd,
    ``mode`` padding (``F.pad``'s), in place: K shifted multiply-adds over the whole batch."""
    radius, length = kernels.shape[1] // 2, images.shape[dim]
    padded = F.pad(images, [radius, radius, 0, 0] if dim == -1 else [0, 0, radius, radius], mode=mode)
    taps = [_at(k) for k in kernels.unbind(1)]
    torch.mul(padded.narrow(dim, 0, length), taps[0], out=images)
    for tap in range(1, len(taps)):
        images.addcmul_(taps[tap], padded.narrow(dim, tap, length))
    return images


def _blur_matrix(size: int, sigma: float, device: torch.device) -> torch.Tensor:
    """(size, size) A with A x = x convolved with a Gaussian of ``sigma`` (kernel 8 sigma + 1, odd,
    as torchvision's), reflected at the ends: a separable 2-D blur is A X A^T."""
    radius = int(8 * sigma + 1) // 2
    if radius >= size:
        raise ValueError(f"an elastic sigma of {sigma} needs images larger than {size} pixels")
    weights = _gaussian_kernels(torch.tensor([sigma], device=device), radius)[0]
    source = torch.arange(size, device=device).view(-1, 1) + torch.arange(-radius, radius + 1, device=device)
    source = torch.where(source < 0, -source, source)
    source = torch.where(source >= size, 2 * (size - 1) - source, source)  # reflect, edge not repeated
    return torch.zeros(size, size, device=device).scatter_add_(
        1, source, weights.expand_as(source).contiguous()
    )


def elastic(images: torch.Tensor, noise: torch.Tensor, alpha: float, sigma: float) -> torch.Tensor:
    """``ElasticTransform(alpha, sigma)`` of each view (M, C, H, W) (Simard et al. 2003): the
    displacement field is uniform noise in [-1, 1) (``noise`` (M, 2, H, W) in [0, 1)) smoothed by a
    Gaussian of ``sigma`` pixels (kernel 8 sigma + 1, reflected at the edges) and scaled by alpha / W
    (x) and alpha / H (y) grid units; bilinear, uncovered pixels 0."""
    _, _, h, w = images.shape
    field = _blur_matrix(h, sigma, images.device) @ (noise * 2 - 1) @ _blur_matrix(w, sigma, images.device).T
    field = field * field.new_tensor([alpha / w, alpha / h]).view(1, 2, 1, 1)
    centres = _pixel_centres(w, images.device), _pixel_centres(h, images.device)
    identity = torch.stack(torch.meshgrid(*centres, indexing="xy"), -1)
    grid = identity + field.permute(0, 2, 3, 1)  # (M, H, W, 2): x, y
    return F.grid_sample(images, grid, mode="bilinear", padding_mode="zeros", align_corners=False)


def turn(images: torch.Tensor, quarter_turns: torch.Tensor) -> torch.Tensor:
    """Rotate each square view counter-clockwise by ``quarter_turns`` (M,) x 90 degrees (0..3), as
    PIL's ``Transpose.ROTATE_90/180/270``."""
    for k in (1, 2, 3):
        apply_where(images, quarter_turns == k, lambda x, k=k: torch.rot90(x, k, dims=(-2, -1)))
    return images


# --------------------------------------------------------------------------------------- colour
def grayscale(images: torch.Tensor) -> torch.Tensor:
    """(M, 3, H, W) RGB -> (M, 1, H, W) luma 0.299 R + 0.587 G + 0.114 B (a new tensor); one
    channel is kept; other channel counts give the mean of their channels."""
    if images.shape[1] == 1:
        return images
    if images.shape[1] != 3:
        return images.mean(1, keepdim=True)
    r, g, b = images.unbind(1)
    return torch.mul(r, _LUMA[0]).add_(g, alpha=_LUMA[1]).add_(b, alpha=_LUMA[2]).unsqueeze(1)


def _blend(images: torch.Tensor, other: torch.Tensor, factor: torch.Tensor) -> torch.Tensor:
    """factor x images + (1 - factor) x other, clipped to [0, 1], in place on ``images`` (PIL's
    ``Image.blend`` with ``ImageEnhance``'s factor); ``other`` (M, 1, H, W) or (M, 1, 1, 1) is spent."""
    return images.mul_(_at(factor)).add_(other.mul_(1 - _at(factor))).clamp_(0, 1)


def brightness(images: torch.Tensor, factor: torch.Tensor) -> torch.Tensor:
    """``adjust_brightness``: each view times its factor (M,), clipped (in place)."""
    return images.mul_(_at(factor)).clamp_(0, 1)


def contrast(images: torch.Tensor, factor: torch.Tensor) -> torch.Tensor:
    """``adjust_contrast``: blend each view with the mean of its grayscale image (in place; the mean
    of the luma is the luma of the channel means)."""
    means = images.mean((2, 3))  # (M, C)
    if images.shape[1] == 3:
        means = (means * means.new_tensor(_LUMA)).sum(1, keepdim=True)
    else:  # one channel, or the mean of the channels (``grayscale``)
        means = means.mean(1, keepdim=True)
    return _blend(images, means.view(-1, 1, 1, 1), factor)


def saturation(images: torch.Tensor, factor: torch.Tensor) -> torch.Tensor:
    """``adjust_saturation``: blend each RGB view with its grayscale image, in place (a no-op on
    other than 3 channels)."""
    return images if images.shape[1] != 3 else _blend(images, grayscale(images), factor)


def hue(images: torch.Tensor, shift: torch.Tensor) -> torch.Tensor:
    """``adjust_hue``: rotate the hue of each RGB view by ``shift`` (M,) turns in [-0.5, 0.5]
    (HSV round trip, as torchvision's tensor op), in place; a no-op on other than 3 channels.
    With V = max, L = min, C = V - L of a pixel's channels: 6 hue = (g - b) / C where red is the
    max (red first, then green, as torchvision), 2 + (b - r) / C where green is, 4 + (r - g) / C
    where blue is; the new hue h' = hue + shift mod 1 gives channel n (c_n = 0, 2, 4 for r, g, b)
    L + C clip(2 - min(|y|, 6 - |y|), 0, 1) = L + C clip(||y| - 3| - 1, 0, 1), y = 6 h' - c_n.
    Written on channel planes with arithmetic only (a CPU's ``where``, comparisons and ``remainder`` cost ten times a multiply)."""
    if images.shape[1] != 3:
        return images
    r, g, b = images.unbind(1)
    value, low = torch.maximum(r, g), torch.minimum(r, g)
    value, low = torch.maximum(value, b, out=value), torch.minimum(low, b, out=low)
    chroma = torch.sub(value, low)
    # 1.0 where the channel is the max (red first, then green, as torchvision picks), else 0.0
    is_r = torch.sub(value, r).ceil_().neg_().add_(1)
    is_g = torch.sub(value, g).ceil_().neg_().add_(1).sub_(is_r).clamp_(min=0)
    # 6 hue C = (4 C + r - g) + is_r (2 g - b - r - 4 C) + is_g (g + b - 2 r - 2 C)
    sector = torch.sub(r, g).add_(chroma, alpha=4)
    term = torch.add(g, g).sub_(b).sub_(r).sub_(chroma, alpha=4).mul_(is_r)
    sector.add_(term)
    term = torch.add(g, b).sub_(r, alpha=2).sub_(chroma, alpha=2).mul_(is_g)
    sector.add_(term).div_(chroma.clamp(min=_TINY))
    turns = sector.add_(6 * shift.view(-1, 1, 1))  # 6 h', before mod 6
    turns.sub_(torch.mul(turns, 1 / 6, out=term).floor_(), alpha=6)
    for n, channel in enumerate((r, g, b)):  # the input planes are no longer read
        ramp = torch.sub(turns, 2 * n, out=term).abs_().sub_(3).abs_().sub_(1).clamp_(0, 1)
        torch.addcmul(low, ramp, chroma, out=channel)
    return images


JITTER_OPS = (brightness, contrast, saturation, hue)  # ColorJitter's fn_idx 0..3


def color_jitter(
    images: torch.Tensor, chosen: torch.Tensor, order: torch.Tensor, factors: torch.Tensor
) -> torch.Tensor:
    """``ColorJitter`` of the ``chosen`` (M,) bool views, in place: each view's four ops in its own
    ``order`` (M, 4), a permutation of 0..3 (brightness, contrast, saturation, hue), with its
    ``factors`` (M, 4) in that op order. The other views are left as they are. Views of other than
    3 channels get brightness and contrast only (saturation and hue are RGB's)."""
    ops = JITTER_OPS if images.shape[1] == 3 else JITTER_OPS[:2]
    slots = order.masked_fill(~chosen.view(-1, 1), -1).T.tolist()  # slots[s][m]: view m's op s, -1: none
    for ops_in_slot in slots:
        for op_index, op in enumerate(ops):
            members = [m for m, o in enumerate(ops_in_slot) if o == op_index]
            apply_to(images, members, op, factors[:, op_index])
    return images


def _box_kernels(sigma: torch.Tensor, passes: int) -> torch.Tensor:
    """(M, 2 r + 1) the box of PIL's ``GaussianBlur(sigma)`` (extended box blur, Gwosdek et al.
    2011): ``passes`` of it have variance sigma^2. Its radius l + a weighs the 2 l + 1 pixels around
    each one by 1 and the next two by a (0 <= a < 1), over 2 l + 1 + 2 a, with s2 = sigma^2 / passes,
    l = floor((sqrt(12 s2 + 1) - 1) / 2), a = (2 l + 1) (l (l + 1) - 3 s2) / (6 (s2 - (l + 1)^2))."""
    shapes = []  # (l, a) per view, in Python's doubles: a few numbers, no tensor ops to dispatch
    for s in sigma.double().tolist():
        var = s * s / passes
        whole = math.floor((math.sqrt(12 * var + 1) - 1) / 2)
        shapes.append(
            (whole, (2 * whole + 1) * (whole * (whole + 1) - 3 * var) / (6 * (var - (whole + 1) ** 2)))
        )
    reach = max(whole for whole, _ in shapes) + 1
    box = [
        [1.0 if abs(x) <= whole else part if abs(x) == whole + 1 else 0.0 for x in range(-reach, reach + 1)]
        for whole, part in shapes
    ]
    box = torch.tensor(box, dtype=torch.float64, device=sigma.device)
    return (box / box.sum(1, keepdim=True)).float()


def _box_blur_matrices(box: torch.Tensor, size: int, passes: int) -> torch.Tensor:
    """(M, size, size) A = B^passes, B x = x convolved with the view's ``box`` (M, K) (``_box_kernels``),
    the edge pixels of x repeated (as each of PIL's passes does): made by blurring the identity."""
    eye = torch.zeros(len(box), 1, size, size, device=box.device)
    eye.diagonal(dim1=-2, dim2=-1).fill_(1)
    for _ in range(passes):
        eye = _blur_lines(eye, box, -2, "replicate")
    return eye.squeeze(1)


def gaussian_blur(images: torch.Tensor, sigma: torch.Tensor, passes: int = 3) -> torch.Tensor:
    """Each view (M, C, H, W) blurred as by PIL's ``GaussianBlur(sigma)`` with its ``sigma`` (M,):
    ``passes`` box blurs along x and y, each repeating the edge pixels of its input, as the matrix
    product A_H X A_W^T (``_box_blur_matrices``; a core's matrix product beats 6 passes of taps
    over the view: a new tensor)."""
    m, c, h, w = images.shape
    box = _box_kernels(sigma, passes)
    rows = _box_blur_matrices(box, h, passes)
    cols = rows if w == h else _box_blur_matrices(box, w, passes)
    return torch.matmul(rows.unsqueeze(1), images).view(m, c * h, w).bmm(cols.mT).view(m, c, h, w)


def solarize(images: torch.Tensor) -> torch.Tensor:
    """``RandomSolarize(128)``: values >= 128 / 255 inverted."""
    return torch.where(images >= 128 / 255, 1 - images, images)


def normalize(images: torch.Tensor, mean: Sequence[float], std: Sequence[float]) -> torch.Tensor:
    """(M, C, H, W) in [0, 1] -> (M, K, H, W) (x - mean) / std per channel, K = len(mean), in
    place when C = K: a one-channel view given K values becomes K channels (grey views for an RGB
    trunk)."""
    if images.shape[1] == len(mean):
        mean_t, std_t = (images.new_tensor(list(v)).view(1, -1, 1, 1) for v in (mean, std))
        return images.sub_(mean_t).div_(std_t)
    out = images.new_empty(len(images), len(mean), *images.shape[2:])
    for channel, (m, s) in enumerate(zip(mean, std)):
        torch.sub(images[:, 0], m, out=out[:, channel]).div_(s)
    return out
