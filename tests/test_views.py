"""Batched views (vistrain/data/views.py, transforms.MultiCropTransform) against torchvision and PIL:
each operation against its torchvision (or PIL) counterpart on single views, then whole views
against the PIL chain the transform replaces, in distribution."""

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from PIL import Image, ImageFilter
from torchvision import transforms as T
from torchvision.transforms import functional as TF

from vistrain.config.defaults import get_defaults
from vistrain.data import views as V
from vistrain.data.transforms import NUM_DRAWS, MultiCropTransform


def _rand(*shape, seed=0):
    return torch.rand(*shape, generator=torch.Generator().manual_seed(seed))


# ----------------------------------------------------------------------- one op, one view
@pytest.mark.parametrize("size", [7, 24, 48])
def test_resized_crops_are_antialiased_bilinear(size):
    images = _rand(3, 2, 40, 30)
    boxes = torch.tensor([[0, 0, 40, 30], [5, 3, 11, 17], [13, 1, 27, 29], [39, 29, 1, 1], [2, 20, 30, 9]])
    source = torch.tensor([0, 1, 2, 0, 1])
    out = V.resized_crops(images, source, boxes, size)
    for m, (top, left, h, w) in enumerate(boxes.tolist()):
        crop = images[source[m], :, top : top + h, left : left + w]
        expected = F.interpolate(crop[None], (size, size), mode="bilinear", antialias=True)[0]
        torch.testing.assert_close(out[m], expected, rtol=0, atol=1e-5)
    # the same as PIL's resize of the cropped image (what RandomResizedCrop did), to its rounding
    pixels = (images[0, 0] * 255).round().to(torch.uint8)
    pil = Image.fromarray(pixels.numpy()).crop((3, 5, 20, 16)).resize((size, size), Image.BILINEAR)
    ours = V.resized_crops(pixels[None, None].float(), torch.tensor([0]), boxes[1:2], size)[0, 0]
    assert (ours - torch.from_numpy(np.array(pil)).float()).abs().max() <= 1.0


def test_8_bit_crops_are_resized_in_8_bits_as_pil():
    pixels = (_rand(3, 40, 30, seed=2) * 255).round().to(torch.uint8)
    boxes = torch.tensor([[5, 3, 11, 17], [0, 0, 40, 30], [13, 1, 27, 29]])
    for size in (7, 24):
        ours = V.resized_crops([pixels], torch.tensor([0, 0, 0]), boxes, size) * 255
        assert torch.equal(ours, ours.round())  # whole levels, as PIL's
        for m, (top, left, h, w) in enumerate(boxes.tolist()):
            image = Image.fromarray(pixels.permute(1, 2, 0).numpy()).crop((left, top, left + w, top + h))
            pil = torch.from_numpy(np.array(image.resize((size, size), Image.BILINEAR))).permute(2, 0, 1)
            assert (ours[m] - pil.float()).abs().max() <= 1.0
            # other devices resize in float and round: the same to one level
            crop = pixels[None, :, top : top + h, left : left + w].float()
            rounded = F.interpolate(crop, (size, size), mode="bilinear", antialias=True).round()
            assert (ours[m] - rounded[0]).abs().max() <= 1.0


def test_affine_and_elastic_match_torchvision():
    images = _rand(4, 3, 20, 26)
    angle, tx, ty = (
        torch.tensor([10.0, -30.0, 0.0, 170.0]),
        torch.tensor([2.0, -3, 0, 1]),
        torch.tensor([1.0, 0, -4, 2]),
    )
    zoom, shear = torch.tensor([0.9, 1.15, 1.0, 0.7]), torch.tensor([5.0, -10.0, 0.0, 20.0])
    out = V.warp_affine(images, V.affine_inverse(angle, tx, ty, zoom, shear))
    for m in range(4):
        expected = TF.affine(
            images[m], angle[m].item(), [int(tx[m]), int(ty[m])], zoom[m].item(), [shear[m].item(), 0.0],
            interpolation=T.InterpolationMode.BILINEAR,
        )  # fmt: skip
        torch.testing.assert_close(out[m], expected, rtol=0, atol=1e-5)
    noise, alpha, sigma = _rand(4, 2, 20, 26, seed=1), 20.0, 2.5
    out = V.elastic(images, noise, alpha, sigma)
    k = int(8 * sigma + 1) | 1
    for m in range(4):  # T.ElasticTransform.get_params with this noise
        dx = TF.gaussian_blur(noise[m : m + 1, :1] * 2 - 1, [k, k], [sigma, sigma]) * alpha / 26
        dy = TF.gaussian_blur(noise[m : m + 1, 1:] * 2 - 1, [k, k], [sigma, sigma]) * alpha / 20
        expected = TF.elastic_transform(images[m], torch.cat([dx, dy], 1).permute(0, 2, 3, 1))
        torch.testing.assert_close(out[m], expected, rtol=0, atol=1e-5)


def test_colour_ops_match_torchvision():
    images = _rand(5, 3, 9, 11)
    factors, shifts = torch.tensor([0.3, 0.9, 1.0, 1.4, 2.0]), torch.tensor([-0.5, -0.1, 0.0, 0.23, 0.5])
    checks = [
        (V.brightness, TF.adjust_brightness, factors),
        (V.contrast, TF.adjust_contrast, factors),
        (V.saturation, TF.adjust_saturation, factors),
        (V.hue, TF.adjust_hue, shifts),
    ]
    for ours, theirs, values in checks:  # luma 0.299 R (PIL's, as the PIL chain) where torchvision has 0.2989
        out = ours(images.clone(), values)
        for m in range(5):
            torch.testing.assert_close(out[m], theirs(images[m], values[m].item()), rtol=0, atol=2e-4)
    gray = images[:, :1]
    torch.testing.assert_close(V.contrast(gray.clone(), factors)[1], TF.adjust_contrast(gray[1], 0.9))
    assert torch.equal(V.hue(gray.clone(), shifts), gray) and torch.equal(V.saturation(gray, factors), gray)
    torch.testing.assert_close(V.grayscale(images), TF.rgb_to_grayscale(images), rtol=0, atol=2e-4)
    torch.testing.assert_close(V.solarize(images), TF.solarize(images, 128 / 255))
    # each view's four ops in its own order: order (3, 0, 1, 2) is hue, brightness, contrast, saturation
    order = torch.tensor([[3, 0, 1, 2]] * 5)
    table = torch.stack([factors, factors.flip(0), factors, shifts], 1)
    chosen = torch.tensor([True, True, False, True, True])
    out = V.color_jitter(images.clone(), chosen, order, table)
    assert torch.equal(out[2], images[2])  # not chosen: left as it was
    for m in (0, 1, 3, 4):
        expected = TF.adjust_hue(images[m], shifts[m].item())
        for op, value in ((TF.adjust_brightness, factors[m]), (TF.adjust_contrast, factors.flip(0)[m])):
            expected = op(expected, value.item())
        expected = TF.adjust_saturation(expected, factors[m].item())
        torch.testing.assert_close(out[m], expected, rtol=0, atol=2e-4)


def test_blur_and_turns_match_pil():
    pixels = (_rand(3, 1, 24, 24) * 255).round()
    sigma = torch.tensor([0.1, 0.6, 1.8])
    out = V.gaussian_blur(pixels.clone(), sigma)
    for m in range(3):  # PIL rounds to 8 bits after each of its 6 passes
        image = Image.fromarray(pixels[m, 0].to(torch.uint8).numpy())
        pil = torch.from_numpy(np.array(image.filter(ImageFilter.GaussianBlur(sigma[m].item())))).float()
        assert (out[m, 0] - pil).abs().max() <= 3 and (out[m, 0] - pil).abs().mean() < 1.1
    turned = V.turn(pixels.clone(), torch.tensor([1, 2, 3]))
    for m, name in enumerate(("ROTATE_90", "ROTATE_180", "ROTATE_270")):
        image = Image.fromarray(pixels[m, 0].to(torch.uint8).numpy()).transpose(
            getattr(Image.Transpose, name)
        )
        assert torch.equal(turned[m, 0], torch.from_numpy(np.array(image)).float())


def test_crop_boxes_follow_random_resized_crop():
    heights, widths, n = torch.full((4000,), 30), torch.full((4000,), 50), 4000
    u = _rand(n, 22, seed=3)
    boxes = V.crop_boxes(u[:, :10], u[:, 10:20], u[:, 20:], heights, widths, (0.1, 0.9))
    image = torch.zeros(1, 30, 50)
    torch.manual_seed(0)
    theirs = torch.tensor(
        [T.RandomResizedCrop.get_params(image, [0.1, 0.9], [3 / 4, 4 / 3]) for _ in range(n)]
    )
    for name, box in (("ours", boxes), ("torchvision", theirs)):
        top, left, h, w = box.T
        assert (top >= 0).all() and (left >= 0).all() and (top + h <= 30).all() and (left + w <= 50).all(), (
            name
        )
    for stat in (
        lambda b: b[:, 2] * b[:, 3] / 1500.0,
        lambda b: (b[:, 3] / b[:, 2]).log(),
        lambda b: b[:, 1] / 50.0,
    ):
        ours, ref = stat(boxes).double(), stat(theirs).double()
        se = math.sqrt((ours.var() + ref.var()) / n)
        assert abs(ours.mean() - ref.mean()) < 4 * se
        for q in (0.1, 0.5, 0.9):
            assert abs(ours.quantile(q) - ref.quantile(q)) < 0.05 * (ref.quantile(0.95) - ref.quantile(0.05))
    # no attempt fits: the whole image cropped to the nearest aspect ratio, centred (as torchvision)
    never = torch.ones(2, 10) * 0.999
    wide = V.crop_boxes(
        never, never, torch.zeros(2, 2), torch.tensor([10, 40]), torch.tensor([40, 10]), (1.0, 1.0)
    )
    assert wide.tolist() == [[0, 13, 10, 13], [13, 0, 13, 10]]


def test_affine_and_jitter_parameters_follow_torchvision():
    cfg = get_defaults().DATA.TRAIN.TRANSFORMS
    cfg.update(AFFINE_DEGREES=15.0, AFFINE_TRANSLATE=0.1, AFFINE_SCALE=[0.85, 1.15], AFFINE_SHEAR=10.0)
    cfg.update(COLOR_DISTORTION=1.5)
    ours, n = MultiCropTransform(cfg), 3000
    u = _rand(n, NUM_DRAWS, seed=4)
    torch.manual_seed(0)
    draws = [
        T.RandomAffine.get_params([-15.0, 15.0], [0.1, 0.1], [0.85, 1.15], [-10.0, 10.0], [40, 30])
        for _ in range(n)
    ]
    theirs = [torch.tensor([d[0] for d in draws]), torch.tensor([float(d[1][0]) for d in draws])]
    theirs += [torch.tensor([float(d[1][1]) for d in draws]), torch.tensor([d[2] for d in draws])]
    theirs += [torch.tensor([d[3][0] for d in draws])]
    assert all(d[3][1] == 0 for d in draws)  # one shear angle: along x
    bounds = [(-15, 15), (-4, 4), (-3, 3), (0.85, 1.15), (-10, 10)]  # shifts: 10% of 40 x 30 px
    for mine, ref, (low, high) in zip(ours.affine_params(u, 30, 40), theirs, bounds):
        assert _ks(mine, ref) < 2.0 and low <= mine.min() and mine.max() <= high
    jitter = T.ColorJitter(1.2, 1.2, 1.2, 0.3)
    draws = [
        jitter.get_params(jitter.brightness, jitter.contrast, jitter.saturation, jitter.hue) for _ in range(n)
    ]
    order, factors = ours.jitter_params(u)
    for k in range(4):
        assert _ks(factors[:, k], torch.tensor([float(d[k + 1]) for d in draws])) < 2.0
    counts = torch.unique(order, dim=0, return_counts=True)[1]  # each of the 24 orders, 1/24 of the time
    assert len(counts) == 24 and (counts - n / 24).abs().max() < 4.5 * math.sqrt(n / 24)


# ------------------------------------------------------------------- whole views, in distribution
class _PilBlur:
    def __init__(self, low, high):
        self.low, self.high = low, high

    def __call__(self, image):
        return image.filter(
            ImageFilter.GaussianBlur(self.low + (self.high - self.low) * torch.rand(()).item())
        )


class _PilTurn:
    def __init__(self, p):
        self.p = p

    def __call__(self, image):
        if torch.rand(()).item() >= self.p:
            return image
        names = ("ROTATE_90", "ROTATE_180", "ROTATE_270")
        return image.transpose(getattr(Image.Transpose, names[int(torch.randint(0, 3, ()).item())]))


def _pil_chain(cfg, size, scale):
    """The chain of torchvision transforms on PIL images that MultiCropTransform makes in batches."""
    ops = []
    if cfg.AFFINE_DEGREES or cfg.AFFINE_TRANSLATE or cfg.AFFINE_SHEAR or list(cfg.AFFINE_SCALE) != [1.0, 1.0]:
        shift = (cfg.AFFINE_TRANSLATE,) * 2 if cfg.AFFINE_TRANSLATE else None
        shear = cfg.AFFINE_SHEAR or None
        ops.append(
            T.RandomAffine(
                cfg.AFFINE_DEGREES, shift, tuple(cfg.AFFINE_SCALE), shear, T.InterpolationMode.BILINEAR
            )
        )
    if cfg.ELASTIC_PROB:
        ops.append(
            T.RandomApply([T.ElasticTransform(cfg.ELASTIC_ALPHA, cfg.ELASTIC_SIGMA)], cfg.ELASTIC_PROB)
        )
    ops += [T.RandomResizedCrop(size, scale=tuple(scale)), T.RandomHorizontalFlip(cfg.HORIZONTAL_FLIP)]
    ops += [T.RandomVerticalFlip(cfg.VERTICAL_FLIP), _PilTurn(cfg.ROTATE_90)]
    s = cfg.COLOR_DISTORTION
    if s > 0:
        ops += [
            T.RandomApply([T.ColorJitter(0.8 * s, 0.8 * s, 0.8 * s, 0.2 * s)], 0.8),
            T.RandomGrayscale(0.2),
        ]
    ops += [
        T.RandomApply([_PilBlur(*cfg.BLUR_RADIUS)], cfg.BLUR_PROB),
        T.RandomSolarize(128, cfg.SOLARIZE_PROB),
    ]
    return T.Compose(ops + [T.ToTensor()])


def _glyphs(n, seed=0):
    """Digit-like grayscale images: random 8 x 8 strokes on black, upscaled bilinearly to 32 x 32."""
    rng = np.random.default_rng(seed)
    small = (rng.random((n, 8, 8)) > 0.6) * rng.integers(128, 256, (n, 8, 8))
    return [np.array(Image.fromarray(s.astype(np.uint8)).resize((32, 32), Image.BILINEAR)) for s in small]


def _photos(n, seed=0):
    """Colourful RGB images: a smooth colour gradient per image with noise, 40 x 36."""
    rng = np.random.default_rng(seed)
    ys, xs = np.mgrid[0:40, 0:36] / 40.0
    out = []
    for _ in range(n):
        a, b, c = rng.random((3, 3))
        pixels = (a * xs[..., None] + b * ys[..., None]) / 2 + c / 2 + 0.15 * rng.standard_normal((40, 36, 3))
        out.append((np.clip(pixels, 0, 1) * 255).astype(np.uint8))
    return out


def _statistics(views):
    """Per view (M, 11): channel means (3) and standard deviations (3), mean |difference| of
    neighbours along x and y (sharpness), mean max - min over channels (colourfulness), and the
    brightness centroid (x, y) as a fraction of the side (where flips and turns put things)."""
    views = views.expand(-1, 3, -1, -1).double()
    luma = views.mean(1)
    h, w = luma.shape[-2:]
    total = luma.sum((1, 2)) + 1e-9
    centre_x = (luma * torch.arange(w).double()).sum((1, 2)) / total / w
    centre_y = (luma * torch.arange(h).double().view(h, 1)).sum((1, 2)) / total / h
    sharp_x = (views[..., 1:] - views[..., :-1]).abs().mean((1, 2, 3))
    sharp_y = (views[..., 1:, :] - views[..., :-1, :]).abs().mean((1, 2, 3))
    colour = (views.amax(1) - views.amin(1)).mean((1, 2))
    per_view = [sharp_x, sharp_y, colour, centre_x, centre_y]
    return torch.cat([views.mean((2, 3)), views.std((2, 3)), torch.stack(per_view, 1)], 1)


def _ks(a, b):
    """Two-sample Kolmogorov-Smirnov statistic of (n,) samples, scaled by sqrt(n / 2) (for equal
    sizes): above 1.95 with probability 0.001 when both come from one distribution."""
    a, b = a.double().sort().values, b.double().sort().values
    both = torch.cat([a, b])
    gap = torch.searchsorted(a, both, right=True) - torch.searchsorted(b, both, right=True)
    return gap.abs().max().item() / len(a) * math.sqrt(len(a) / 2)


DIGITS = dict(
    SIZE_CROPS=[28], CROP_SCALES=[[0.5, 1.0]], HORIZONTAL_FLIP=0.0, AFFINE_DEGREES=15.0, AFFINE_TRANSLATE=0.1,
    AFFINE_SCALE=[0.85, 1.15], AFFINE_SHEAR=10.0, ELASTIC_PROB=0.3, COLOR_DISTORTION=0.5, BLUR_PROB=0.5,
    BLUR_RADIUS=[0.1, 1.0],
)  # fmt: skip
PHOTOS = dict(
    SIZE_CROPS=[24], CROP_SCALES=[[0.2, 1.0]], HORIZONTAL_FLIP=0.5, VERTICAL_FLIP=0.3, ROTATE_90=0.5,
    COLOR_DISTORTION=1.0, BLUR_PROB=0.5, BLUR_RADIUS=[0.1, 2.0], SOLARIZE_PROB=0.2,
)  # fmt: skip


@pytest.mark.parametrize("settings, images", [(DIGITS, _glyphs), (PHOTOS, _photos)], ids=["digits", "photos"])
def test_views_match_the_pil_chain_in_distribution(settings, images, one_thread):
    cfg = get_defaults().DATA.TRAIN.TRANSFORMS
    cfg.update(NUM_CROPS=[1], MEAN=[0.0] * 3, STD=[1.0] * 3, **settings)
    ours, n = MultiCropTransform(cfg), 1500
    pictures = images(n)
    generator = torch.Generator().manual_seed(0)
    new = ours([ours.prepare(p, generator) for p in pictures])[0]
    torch.manual_seed(0)
    chain = _pil_chain(cfg, cfg.SIZE_CROPS[0], cfg.CROP_SCALES[0])
    old = torch.stack([chain(Image.fromarray(p)).expand(3, -1, -1) for p in pictures])
    a, b = _statistics(new), _statistics(old)
    distances = [_ks(a[:, i], b[:, i]) for i in range(a.shape[1])]
    assert max(distances) < 2.0, f"per-view statistics differ: scaled KS distances {distances}"


def test_flips_and_turns_happen_at_their_rates(one_thread):
    cfg = get_defaults().DATA.TRAIN.TRANSFORMS
    cfg.update(NUM_CROPS=[1], SIZE_CROPS=[8], CROP_SCALES=[[1.0, 1.0]], COLOR_DISTORTION=0.0, BLUR_PROB=0.0)
    image = np.zeros((8, 8), np.uint8)
    image[:4, :4] = 255  # the top-left quadrant
    n = 2000
    for settings, expected in (
        (dict(HORIZONTAL_FLIP=0.3), [0.7, 0.3, 0.0, 0.0]),
        (dict(HORIZONTAL_FLIP=0.0, VERTICAL_FLIP=0.6), [0.4, 0.0, 0.6, 0.0]),
        (dict(HORIZONTAL_FLIP=0.0, ROTATE_90=0.75), [0.25] * 4),
    ):
        cfg.update(**settings)
        ours = MultiCropTransform(cfg)
        generator = torch.Generator().manual_seed(1)
        views = ours([ours.prepare(image, generator) for _ in range(n)])[0][:, 0]
        quadrants = torch.stack([views[:, :4, :4], views[:, :4, 4:], views[:, 4:, :4], views[:, 4:, 4:]], 1)
        bright = quadrants.mean((2, 3)).argmax(1)  # top-left, top-right, bottom-left, bottom-right
        rates = torch.bincount(bright, minlength=4).double() / n
        for rate, p in zip(rates.tolist(), expected):
            assert abs(rate - p) <= 4 * math.sqrt(p * (1 - p) / n) + 1e-9, (settings, rates.tolist())
