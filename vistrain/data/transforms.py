"""SSL image transforms (config: ``DATA.<split>.TRANSFORMS``): per image the work that must be
per image, per batch the rest, as tensor operations on all the batch's views at once (``views.py``).

``multicrop`` (SimCLR, Chen et al. 2020; SwAV multi-crop, Caron et al. 2020): for every resolution
``i``, ``NUM_CROPS[i]`` views of side ``SIZE_CROPS[i]``, each made independently by the torchvision
chain

    [RandomAffine(AFFINE_DEGREES, translate, scale, shear)]   (digits: small rotations/shifts, black fill)
    -> [RandomApply([ElasticTransform(ELASTIC_ALPHA, ELASTIC_SIGMA)], p=ELASTIC_PROB)]
    -> RandomResizedCrop(SIZE_CROPS[i], scale=CROP_SCALES[i])
    -> RandomHorizontalFlip(HORIZONTAL_FLIP) -> RandomVerticalFlip(VERTICAL_FLIP)
    -> [rotation by 90, 180 or 270 degrees, p=ROTATE_90]   (images with no up: cells, tiles, slides)
    -> RandomApply([ColorJitter(0.8s, 0.8s, 0.8s, 0.2s)], p=0.8) -> RandomGrayscale(0.2)   (s = COLOR_DISTORTION)
    -> RandomApply([Gaussian blur, sigma ~ U(BLUR_RADIUS)], p=BLUR_PROB)   (PIL's, as in SwAV/DINO)
    -> RandomSolarize(128, p=SOLARIZE_PROB)
    -> ToTensor -> Normalize(MEAN, STD)   (a grayscale source's one channel becomes three here)

with the same parameter distributions, in float32 after the crop: an 8-bit image's crops are
resized in 8 bits, as PIL's (whole grey levels, within one of PIL's), and PIL rounds to 8 bits
after each later step too (its affine step truncates: its digit views are about 0.3 grey levels
darker), these ops do not;
``tests/test_views.py`` checks each op against torchvision's or PIL's and the views' statistics
against the PIL chain's. The affine step is left
out when AFFINE_DEGREES, AFFINE_TRANSLATE and AFFINE_SHEAR are 0 and AFFINE_SCALE is [1, 1]; every
other step whose probability or strength is 0 is left out too. The geometric steps come first so
that they act on the whole image, before the crop picks a part. A grayscale source's views are made
on its one channel (a third of the work; saturation, hue and grayscale are no-ops on it). The output
is a list of float32 tensors (N, C, SIZE_CROPS[i], SIZE_CROPS[i]) in config order, so views of one
resolution are consecutive.

Channels and depth (``vistrain/data/pixels.py``): the views have C = ``DATA.CHANNELS`` channels (3
by default). 8-bit images are scaled by 1/255 as ToTensor does; other dtypes (16-bit PNG and TIFF,
``.npy`` arrays) and 8-bit images with a ``DATA.<split>.PIXEL_RANGE`` are scaled to [0, 1] per image, before the
views, by (x - low) / (high - low), clipped, [low, high] = ``PIXEL_RANGE`` or the dtype's range.
Geometry, flips, brightness, contrast and blur act on any number of channels (contrast blends with
the mean of the view's grey image: luma for RGB, the mean of the channels for other than 1 or 3).
Saturation, hue and random grayscale need RGB: on one channel they do nothing; on views of other
than 1 or 3 channels they are skipped, and so is solarisation (its threshold is a colour's), with
one log line when the recipe asks for them. ``Normalize`` takes MEAN / STD of C values, or one
value for every channel; 1-channel views given 3 values take their averages (a grey image's three
equal channels).

``eval``: Resize(RESIZE) -> CenterCrop(CENTER_CROP) (PIL, per image) -> ToTensor -> Normalize: a
one-element list. Images PIL cannot hold (other than 8-bit with 1 or 3 channels, or with a
PIXEL_RANGE) are scaled to [0, 1] first and resized as tensors (bilinear, antialiased).

Randomness: a view's parameters are uniforms drawn, per image, from the generator the dataset seeds
with (seed, epoch, index) (``vistrain.data.datasets.SSLDataset``), so the views are a function of
(seed, epoch, index), whatever the batch, the worker count or the rank.
"""

import logging
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch
from PIL import Image
from torchvision.transforms import functional as TF

from vistrain.data import views as V
from vistrain.data.pixels import check_pixel_range, fit_normalization, keeps_bytes, to_unit

logger = logging.getLogger(__name__)


def _check_multicrop(cfg) -> None:
    counts, sizes, scales = list(cfg.NUM_CROPS), list(cfg.SIZE_CROPS), list(cfg.CROP_SCALES)
    if not counts or not len(counts) == len(sizes) == len(scales):
        raise ValueError(
            "TRANSFORMS.NUM_CROPS, SIZE_CROPS and CROP_SCALES need one entry per resolution, got "
            f"{counts}, {sizes}, {scales}"
        )
    for count, size, scale in zip(counts, sizes, scales):
        if count < 1 or size < 1:
            raise ValueError(f"TRANSFORMS: crop counts and sizes must be >= 1, got {count} x {size}")
        if len(scale) != 2 or not 0 < scale[0] <= scale[1] <= 1:
            raise ValueError(
                f"TRANSFORMS.CROP_SCALES entries must be [lo, hi] with 0 < lo <= hi <= 1, got {scale}"
            )
    if len(cfg.BLUR_RADIUS) != 2 or not 0 < cfg.BLUR_RADIUS[0] <= cfg.BLUR_RADIUS[1]:
        raise ValueError(f"TRANSFORMS.BLUR_RADIUS must be [lo, hi] with 0 < lo <= hi, got {cfg.BLUR_RADIUS}")
    _check_geometric(cfg)
    for key in (
        "HORIZONTAL_FLIP",
        "VERTICAL_FLIP",
        "ROTATE_90",
        "BLUR_PROB",
        "SOLARIZE_PROB",
        "ELASTIC_PROB",
    ):
        if not 0 <= cfg[key] <= 1:
            raise ValueError(f"TRANSFORMS.{key} is a probability, got {cfg[key]}")


def _check_geometric(cfg) -> None:
    if cfg.AFFINE_DEGREES < 0 or cfg.AFFINE_SHEAR < 0 or not 0 <= cfg.AFFINE_TRANSLATE <= 1:
        raise ValueError(
            "TRANSFORMS.AFFINE_DEGREES and AFFINE_SHEAR must be >= 0 and AFFINE_TRANSLATE in [0, 1], got "
            f"{cfg.AFFINE_DEGREES}, {cfg.AFFINE_SHEAR}, {cfg.AFFINE_TRANSLATE}"
        )
    if len(cfg.AFFINE_SCALE) != 2 or not 0 < cfg.AFFINE_SCALE[0] <= cfg.AFFINE_SCALE[1]:
        raise ValueError(
            f"TRANSFORMS.AFFINE_SCALE must be [lo, hi] with 0 < lo <= hi, got {cfg.AFFINE_SCALE}"
        )
    if cfg.ELASTIC_ALPHA < 0 or cfg.ELASTIC_SIGMA <= 0:
        raise ValueError(
            f"TRANSFORMS.ELASTIC_ALPHA must be >= 0 and ELASTIC_SIGMA > 0, got {cfg.ELASTIC_ALPHA}, {cfg.ELASTIC_SIGMA}"
        )


def _check_color(cfg) -> None:
    if not 0 <= cfg.COLOR_DISTORTION <= 2.5:  # the hue shift 0.2 s is at most half a turn
        raise ValueError(f"TRANSFORMS.COLOR_DISTORTION must be in [0, 2.5], got {cfg.COLOR_DISTORTION}")


def _layout(**widths: int) -> Dict[str, slice]:
    """Column slices of the uniform draws of one view, in the given order."""
    slices, start = {}, 0
    for name, width in widths.items():
        slices[name] = slice(start, start + width)
        start += width
    return slices


# Every view draws these uniforms in [0, 1), whether its config uses them or not (so the draws of a
# view do not depend on the rest of the config); ``MultiCropTransform.prepare`` draws them.
DRAWS = _layout(
    area=10, ratio=10, place=2,  # RandomResizedCrop: 10 attempts (area, aspect), then top, left
    affine=5,  # angle, shift x, shift y, zoom, shear
    elastic=1, hflip=1, vflip=1, rotate=2,  # coins; rotate: coin, quarter turns
    jitter=1, order=4, factors=4,  # coin, the order of the 4 ops, brightness/contrast/saturation/hue
    gray=1, blur=2, solarize=1,  # coins; blur: coin, sigma
)  # fmt: skip
NUM_DRAWS = max(s.stop for s in DRAWS.values())


def _column(draws: torch.Tensor, name: str) -> torch.Tensor:
    """(M, NUM_DRAWS) -> the (M,) or (M, width) columns of ``name``."""
    part = draws[:, DRAWS[name]]
    return part.squeeze(1) if part.shape[1] == 1 else part


def _uniform(u: torch.Tensor, low: float, high: float) -> torch.Tensor:
    return low + (high - low) * u


def to_pixels(image: np.ndarray) -> torch.Tensor:
    """A source's array (H, W) or (H, W, C) -> tensor (C, H, W) of its dtype (shares memory)."""
    pixels = torch.from_numpy(image if image.flags.writeable else image.copy())
    return pixels.unsqueeze(0) if pixels.ndim == 2 else pixels.permute(2, 0, 1)


def unit_pixels(image: np.ndarray, pixel_range: Sequence[float]) -> torch.Tensor:
    """(C, H, W): uint8 as it is (scaled with its batch), any other dtype or a PIXEL_RANGE already
    scaled to float32 in [0, 1] (``vistrain.data.pixels.to_unit``)."""
    return unit_tensor(to_pixels(image), pixel_range)


def unit_tensor(pixels: torch.Tensor, pixel_range: Sequence[float]) -> torch.Tensor:
    """:func:`unit_pixels` of pixels (C, H, W) already a tensor."""
    return pixels if keeps_bytes(pixels, pixel_range) else to_unit(pixels, pixel_range)


def _stack(pixels: Sequence[torch.Tensor]) -> torch.Tensor:
    """Same-size images (uint8, or float in [0, 1]) -> float (N, C, H, W) in [0, 1]; one-channel
    ones repeated to the others' channels if any has more."""
    channels = max(p.shape[0] for p in pixels)
    if any(p.shape[0] != channels for p in pixels):
        pixels = [p.expand(channels, -1, -1) for p in pixels]
    if all(p.dtype == torch.uint8 for p in pixels):
        return torch.stack(pixels).float().div_(255)
    return torch.stack([_to_float(p) for p in pixels])


def _to_float(pixels: torch.Tensor) -> torch.Tensor:
    """uint8 -> float32 in [0, 1] (/ 255); float pixels (already in [0, 1]) as they are."""
    return pixels.float().div_(255) if pixels.dtype == torch.uint8 else pixels


# Views made on a CPU are coloured this many values (views x channels x side^2) at a time: a chunk
# of about 1 MB of float32 stays in the core's cache through the dozens of passes the colour steps
# make (a 224 px RGB view alone is 0.6 MB); other devices take the batch at once.
CPU_COLOUR_CHUNK = 1 << 18


class MultiCropTransform:
    """Multi-crop views, made a batch at a time (see the module docstring).

    ``prepare(image, generator)``, per image: its pixels (C, H, W) (uint8, or float32 in [0, 1] for
    other depths: ``unit_pixels``) and, per resolution, the
    uniforms of its views (NUM_CROPS[i], NUM_DRAWS) and, with the elastic step, their noise fields
    (NUM_CROPS[i], 2, H, W), drawn from ``generator``. ``transform(prepared_list)``, per batch of N:
    List[Tensor (N, C, SIZE_CROPS[i], SIZE_CROPS[i]) float32], NUM_CROPS[0] entries, then NUM_CROPS[1]...
    A view depends only on its image and its draws, not on the rest of the batch. ``channels``: C,
    ``DATA.CHANNELS``; ``mean_std``: normalisation computed from the data (else MEAN / STD).
    """

    def __init__(
        self,
        cfg,
        channels: int = 3,
        mean_std: Optional[Tuple[Sequence[float], Sequence[float]]] = None,
        pixel_range: Sequence[float] = (),
    ):
        _check_multicrop(cfg)
        _check_color(cfg)
        self.crops = [
            (int(c), int(s), tuple(float(v) for v in sc))
            for c, s, sc in zip(cfg.NUM_CROPS, cfg.SIZE_CROPS, cfg.CROP_SCALES)
        ]
        zoom = tuple(float(v) for v in cfg.AFFINE_SCALE)
        on = cfg.AFFINE_DEGREES > 0 or cfg.AFFINE_TRANSLATE > 0 or cfg.AFFINE_SHEAR > 0 or zoom != (1.0, 1.0)
        self.affine = (
            (float(cfg.AFFINE_DEGREES), float(cfg.AFFINE_TRANSLATE), zoom, float(cfg.AFFINE_SHEAR))
            if on
            else None
        )
        on = cfg.ELASTIC_PROB > 0 and cfg.ELASTIC_ALPHA > 0
        self.elastic = (
            (float(cfg.ELASTIC_PROB), float(cfg.ELASTIC_ALPHA), float(cfg.ELASTIC_SIGMA)) if on else None
        )
        self.flips = (float(cfg.HORIZONTAL_FLIP), float(cfg.VERTICAL_FLIP), float(cfg.ROTATE_90))
        self.strength = float(cfg.COLOR_DISTORTION)
        self.blur = (float(cfg.BLUR_PROB), *(float(v) for v in cfg.BLUR_RADIUS))
        self.solarize = float(cfg.SOLARIZE_PROB)
        self.pixel_range = _pixel_range(pixel_range)
        self.mean, self.std = fit_normalization(cfg.MEAN, cfg.STD, channels, mean_std)
        if channels not in (1, 3) and (self.strength > 0 or self.solarize > 0):
            logger.info(
                f"views of {channels} channels: colour jitter is brightness and contrast only; saturation, "
                "hue, random grayscale and solarisation are skipped (they need RGB)"
            )

    def prepare(self, image: np.ndarray, generator: torch.Generator) -> dict:
        pixels = unit_pixels(image, self.pixel_range)
        return {"pixels": pixels, "draws": self.draw(pixels.shape[1:], generator)}

    def draw(self, size: Sequence[int], generator: torch.Generator) -> list:
        """The draws of :meth:`prepare` for an image of ``size`` (H, W): they need its size only,
        not its pixels (a JPEG decoded later, ``DECODE_ON_DEVICE``, draws from its header's)."""
        draws = []
        for count, _, _ in self.crops:
            uniforms = torch.rand(count, NUM_DRAWS, generator=generator)
            noise = None
            if self.elastic is not None:  # a field for each view the elastic step distorts
                chosen = sum(coin < self.elastic[0] for coin in _column(uniforms, "elastic").tolist())
                noise = torch.rand(chosen, 2, *size, generator=generator)
            draws.append((uniforms, noise))
        return draws

    def scale(self, pixels: torch.Tensor) -> torch.Tensor:
        """Decoded uint8 pixels (C, H, W), on any device, as :meth:`prepare` holds them."""
        return unit_tensor(pixels, self.pixel_range)

    def __call__(self, prepared: Sequence[dict]) -> List[torch.Tensor]:
        views: List[torch.Tensor] = []
        for which, (count, size, scale) in enumerate(self.crops):
            # view-major rows: row v N + n is view v of sample n
            u = torch.stack([p["draws"][which][0] for p in prepared], 1).flatten(0, 1)
            batch = self.colour(self.geometry(prepared, which, u, size, scale), u)
            batch = V.normalize(batch, self.mean, self.std)
            views += batch.unflatten(0, (count, len(prepared))).unbind(0)
        return views

    def geometry(self, prepared, which: int, u: torch.Tensor, size: int, scale) -> torch.Tensor:
        """The crops of resolution ``which`` of N prepared samples, whose draws are ``u`` (count N,
        NUM_DRAWS) view-major: float (count N, C, size, size) in [0, 1], C the most channels any
        image has. The boxes of all views are drawn at once; images of one size are cropped together."""
        n, device = len(prepared), u.device
        count = u.shape[0] // n
        groups: Dict[tuple, List[int]] = {}
        for i, p in enumerate(prepared):
            groups.setdefault(tuple(p["pixels"].shape[1:]), []).append(i)
        channels = max(p["pixels"].shape[0] for p in prepared)
        sides = torch.tensor([p["pixels"].shape[1:] for p in prepared], device=device).repeat(count, 1)
        boxes = V.crop_boxes(
            _column(u, "area"), _column(u, "ratio"), _column(u, "place"), sides[:, 0], sides[:, 1], scale
        )  # of every view at once; the affine and elastic steps keep the image's size
        out = torch.empty(count * n, channels, size, size, device=device)
        for members in groups.values():
            images = [V.resizable(prepared[i]["pixels"].expand(channels, -1, -1)) for i in members]
            rows = (
                torch.arange(count, device=device)[:, None] * n + torch.tensor(members, device=device)
            ).flatten()
            noise = None
            if self.elastic is not None:
                noise = self._noise([prepared[i]["draws"][which][1] for i in members], u[rows])
            self._crop(images, u[rows], boxes[rows], noise, size, out, rows.tolist())
        return out

    def _noise(self, fields: Sequence[torch.Tensor], u: torch.Tensor) -> torch.Tensor:
        """The images' elastic noise fields (k_j, 2, H, W) in the order of the distorted rows of
        ``u`` (view-major: row v n + j is view v of image j)."""
        n = len(fields)
        chosen = (_column(u, "elastic") < self.elastic[0]).view(-1, n)  # (views, images)
        first = torch.tensor([0] + [len(f) for f in fields], device=u.device).cumsum(0)[
            :-1
        ]  # image j's first
        index = first + chosen.long().cumsum(0) - 1  # view v of image j: its field
        return torch.cat(list(fields))[index[chosen]]

    def _crop(
        self,
        images,
        u: torch.Tensor,
        boxes: torch.Tensor,
        noise,
        size: int,
        out: torch.Tensor,
        rows: List[int],
    ) -> None:
        """Affine, elastic, resized crop ``boxes`` (row v n + j: view v of image j, as ``u``) of n
        same-size images (C, H, W) (uint8, or float in [0, 1]) into ``out[rows]`` (float (C, size, size) in [0, 1] each);
        ``noise``: the fields of the distorted rows, in order."""
        n, (height, width) = len(images), images[0].shape[1:]
        source = torch.arange(u.shape[0], device=u.device) % n
        if self.affine is not None or self.elastic is not None:
            images = torch.stack([_to_float(p) for p in images])[source]  # a copy per view
            source = torch.arange(u.shape[0], device=u.device)
        if self.affine is not None:
            images = V.warp_affine(images, V.affine_inverse(*self.affine_params(u, height, width)))
        if self.elastic is not None:
            prob, alpha, sigma = self.elastic
            chosen = (_column(u, "elastic") < prob).nonzero().squeeze(1)
            if chosen.numel():
                images[chosen] = V.elastic(images[chosen], noise, alpha, sigma)
        V.resized_crops(images, source, boxes, size, out, rows)

    def affine_params(self, u: torch.Tensor, height: int, width: int) -> Tuple[torch.Tensor, ...]:
        """(angle, tx, ty, zoom, shear), each (M,), of the views whose draws are ``u`` (M,
        NUM_DRAWS), as ``RandomAffine.get_params``: angle U(+-degrees), whole-pixel shifts
        round(U(+-t W)) and round(U(+-t H)), zoom U(AFFINE_SCALE), x shear U(+-shear)."""
        degrees, translate, zoom, shear = self.affine
        angle, dx, dy, s, sh = _column(u, "affine").unbind(1)
        tx = _uniform(dx, -translate * width, translate * width).round()
        ty = _uniform(dy, -translate * height, translate * height).round()
        return _uniform(angle, -degrees, degrees), tx, ty, _uniform(s, *zoom), _uniform(sh, -shear, shear)

    def jitter_params(self, u: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """(order (M, 4), factors (M, 4)) of the views whose draws are ``u``, as
        ``ColorJitter.get_params`` for strength s: a uniformly random order of brightness, contrast,
        saturation, hue; factors U(max(0, 1 - 0.8 s), 1 + 0.8 s) for the first three, U(+-0.2 s) for hue."""
        jitter = 0.8 * self.strength
        lows = u.new_tensor([max(0.0, 1 - jitter)] * 3 + [-0.25 * jitter])
        highs = u.new_tensor([1 + jitter] * 3 + [0.25 * jitter])
        return _column(u, "order").argsort(1), lows + (highs - lows) * _column(u, "factors")

    def colour(self, batch: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
        """Flips, quarter turns, colour jitter, grayscale, blur, solarisation, each with its
        probability, in place on ``batch`` (M, C, s, s), in chunks on a CPU (``CPU_COLOUR_CHUNK``);
        chunks of several views take them sorted by jitter order (the same views, made faster)."""
        step = len(batch)
        if batch.device.type == "cpu":
            step = max(1, CPU_COLOUR_CHUNK // batch[0].numel())
        grouped = step > 1 and self.strength > 0
        if grouped:  # views of one jitter order side by side: each op runs on slices, not gathered copies
            jittered = _column(u, "jitter") < 0.8
            key = torch.where(
                jittered, (self.jitter_params(u)[0] * u.new_tensor([64, 16, 4, 1])).sum(1), 256.0
            )
            perm = torch.argsort(key, stable=True)
            views, u = batch.index_select(0, perm), u.index_select(0, perm)
        else:
            views = batch
        for start in range(0, len(batch), step):  # each view's steps depend on it alone
            self._colour_chunk(views[start : start + step], u[start : start + step])
        return batch.index_copy_(0, perm, views) if grouped else batch

    def _colour_chunk(self, batch: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
        hflip, vflip, rotate = self.flips
        if hflip > 0:
            V.apply_where(batch, _column(u, "hflip") < hflip, lambda x: x.flip(-1))
        if vflip > 0:
            V.apply_where(batch, _column(u, "vflip") < vflip, lambda x: x.flip(-2))
        if rotate > 0:
            coin, turns = _column(u, "rotate").unbind(1)
            V.turn(batch, torch.where(coin < rotate, 1 + (3 * turns).long(), 0))
        if self.strength > 0:
            order, factors = self.jitter_params(u)
            V.color_jitter(batch, _column(u, "jitter") < 0.8, order, factors)
            if batch.shape[1] == 3:
                V.apply_where(batch, _column(u, "gray") < 0.2, lambda x: V.grayscale(x).expand(-1, 3, -1, -1))
        prob, low, high = self.blur
        if prob > 0:
            coin, sigma = _column(u, "blur").unbind(1)
            V.apply_where(batch, coin < prob, V.gaussian_blur, _uniform(sigma, low, high))
        if self.solarize > 0 and batch.shape[1] in (1, 3):
            V.apply_where(batch, _column(u, "solarize") < self.solarize, V.solarize)
        return batch


def _pixel_range(pixel_range: Sequence[float]) -> List[float]:
    check_pixel_range(pixel_range)
    return [float(v) for v in pixel_range]


class EvalTransform:
    """Resize the shorter side to RESIZE, crop the centre CENTER_CROP (per image, PIL, bilinear;
    images PIL cannot hold: as float tensors), normalise (per batch): ``transform(prepared_list)``
    -> [Tensor (N, C, CENTER_CROP, CENTER_CROP)]; ``channels``, ``mean_std`` as MultiCropTransform's."""

    def __init__(self, cfg, channels: int = 3, mean_std=None, pixel_range: Sequence[float] = ()):
        if cfg.RESIZE < cfg.CENTER_CROP:
            raise ValueError(f"TRANSFORMS.RESIZE ({cfg.RESIZE}) must be >= CENTER_CROP ({cfg.CENTER_CROP})")
        self.resize, self.crop = int(cfg.RESIZE), int(cfg.CENTER_CROP)
        self.pixel_range = _pixel_range(pixel_range)
        self.mean, self.std = fit_normalization(cfg.MEAN, cfg.STD, channels, mean_std)

    def prepare(self, image: np.ndarray, generator: torch.Generator = None) -> dict:
        if image.dtype == np.uint8 and not self.pixel_range and (image.ndim == 2 or image.shape[2] == 3):
            resized = TF.resize(Image.fromarray(image), self.resize)
            return {"pixels": to_pixels(np.array(TF.center_crop(resized, self.crop)))}
        pixels = unit_pixels(image, self.pixel_range)
        resized = TF.resize(pixels, self.resize, antialias=True)
        return {"pixels": TF.center_crop(resized, self.crop)}

    def __call__(self, prepared: Sequence[dict]) -> List[torch.Tensor]:
        return [V.normalize(_stack([p["pixels"] for p in prepared]), self.mean, self.std)]


TRANSFORMS: Dict[str, Callable] = {"multicrop": MultiCropTransform, "eval": EvalTransform}


def build_transform(transforms_cfg, channels: int = 3, mean_std=None, pixel_range: Sequence[float] = ()):
    """Build the transform named ``transforms_cfg.NAME`` from ``DATA.<split>.TRANSFORMS`` for views
    of ``channels`` channels (``DATA.CHANNELS``) of pixels mapped to [0, 1] from ``pixel_range``
    (``DATA.<split>.PIXEL_RANGE``), normalised by ``mean_std`` when it is given."""
    name = transforms_cfg.NAME
    if name not in TRANSFORMS:
        raise ValueError(f"unknown TRANSFORMS.NAME {name!r}; valid names: {sorted(TRANSFORMS)}")
    return TRANSFORMS[name](transforms_cfg, channels, mean_std, pixel_range)
