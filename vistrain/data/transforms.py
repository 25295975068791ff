"""SSL image transforms (config: ``DATA.<split>.TRANSFORMS``), built from torchvision.transforms.

``multicrop`` (SimCLR, Chen et al. 2020; SwAV multi-crop, Caron et al. 2020): for every resolution
``i``, ``NUM_CROPS[i]`` views of side ``SIZE_CROPS[i]``, each made independently by

    [RandomAffine(AFFINE_DEGREES, translate, scale, shear)]   (digits: small rotations/shifts, black fill)
    -> [RandomApply([ElasticTransform(ELASTIC_ALPHA, ELASTIC_SIGMA)], p=ELASTIC_PROB)]
    -> RandomResizedCrop(SIZE_CROPS[i], scale=CROP_SCALES[i])
    -> RandomHorizontalFlip(HORIZONTAL_FLIP) -> RandomVerticalFlip(VERTICAL_FLIP)
    -> [rotation by 90, 180 or 270 degrees, p=ROTATE_90]   (images with no up: cells, tiles, slides)
    -> RandomApply([ColorJitter(0.8s, 0.8s, 0.8s, 0.2s)], p=0.8) -> RandomGrayscale(0.2)   (s = COLOR_DISTORTION)
    -> RandomApply([Gaussian blur, sigma ~ U(BLUR_RADIUS)], p=BLUR_PROB)   (PIL filter, as in SwAV/DINO)
    -> RandomSolarize(128, p=SOLARIZE_PROB)
    -> [to RGB, if a source gave a grayscale image] -> ToTensor -> Normalize(MEAN, STD)

The affine step is left out when AFFINE_DEGREES, AFFINE_TRANSLATE and AFFINE_SHEAR are 0 and
AFFINE_SCALE is [1, 1]; every other step whose probability or strength is 0 is left out too. The
geometric steps come first so that they act on the whole image, before the crop picks a part. The output is a list of float32 tensors
(3, SIZE_CROPS[i], SIZE_CROPS[i]) in config order, so views of one resolution are consecutive.

``eval``: Resize(RESIZE) -> CenterCrop(CENTER_CROP) -> ToTensor -> Normalize: a one-element list.

Randomness: every op draws from torch's global CPU generator. The dataset seeds it per sample
(see ``vistrain.data.datasets.SSLDataset``), so the views are a function of (seed, epoch, index).
"""

from typing import Callable, Dict, List, Sequence

import torch
from PIL import Image, ImageFilter
from torchvision import transforms as T


class ToRGB:
    """A grayscale PIL image (a source may hand one over: ELPV) to RGB, last, so that every view
    before it was made on one channel (a third of the work) and the trunk still sees three."""

    def __call__(self, image: Image.Image) -> Image.Image:
        return image if image.mode == "RGB" else image.convert("RGB")


def _normalize(cfg) -> List[Callable]:
    if len(cfg.MEAN) != 3 or len(cfg.STD) != 3:
        raise ValueError(f"TRANSFORMS.MEAN and STD need 3 values each, got {cfg.MEAN} and {cfg.STD}")
    return [ToRGB(), T.ToTensor(), T.Normalize(mean=list(cfg.MEAN), std=list(cfg.STD))]


class RandomRotate90:
    """With probability ``p``, rotate by 90, 180 or 270 degrees (equally likely; lossless on a
    square crop). Solar cells, micrographs and satellite tiles have no "up", so these are views of
    the same thing. Draws from torch's generator, like the torchvision ops."""

    def __init__(self, p: float):
        self.p = float(p)

    def __call__(self, image: Image.Image) -> Image.Image:
        if torch.rand(()).item() >= self.p:
            return image
        turns = int(torch.randint(1, 4, ()).item())
        return image.transpose(
            (Image.Transpose.ROTATE_90, Image.Transpose.ROTATE_180, Image.Transpose.ROTATE_270)[turns - 1]
        )

    def __repr__(self) -> str:
        return f"RandomRotate90(p={self.p})"


class GaussianBlurPIL:
    """Blur with sigma ~ U(lo, hi) via PIL (SwAV/DINO style): 10x faster than the tensor kernel on small crops.

    PIL's ``GaussianBlur(radius)`` takes the standard deviation, so no kernel size is needed.
    The draw uses torch's generator like the torchvision ops, so per-sample seeding covers it.
    """

    def __init__(self, sigma: Sequence[float]):
        self.low, self.high = float(sigma[0]), float(sigma[1])

    def __call__(self, image: Image.Image) -> Image.Image:
        sigma = self.low + (self.high - self.low) * torch.rand(()).item()
        return image.filter(ImageFilter.GaussianBlur(radius=sigma))

    def __repr__(self) -> str:
        return f"GaussianBlurPIL(sigma=({self.low}, {self.high}))"


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
    if not cfg.COLOR_DISTORTION >= 0:
        raise ValueError(f"TRANSFORMS.COLOR_DISTORTION must be >= 0, got {cfg.COLOR_DISTORTION}")
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


def geometric_ops(cfg) -> List[Callable]:
    """Shape-changing augmentations for glyph-like images (digits, characters), applied to the whole
    image: RandomAffine (rotation +-AFFINE_DEGREES, shift up to AFFINE_TRANSLATE of the side, zoom
    in AFFINE_SCALE, shear +-AFFINE_SHEAR degrees, uncovered pixels black) and, with probability
    ELASTIC_PROB, an elastic distortion (displacement fields of strength ELASTIC_ALPHA pixels,
    smoothness ELASTIC_SIGMA, Simard et al. 2003). Empty when all are off."""
    ops: List[Callable] = []
    lo, hi = (float(v) for v in cfg.AFFINE_SCALE)
    if cfg.AFFINE_DEGREES > 0 or cfg.AFFINE_TRANSLATE > 0 or cfg.AFFINE_SHEAR > 0 or (lo, hi) != (1.0, 1.0):
        translate = (cfg.AFFINE_TRANSLATE, cfg.AFFINE_TRANSLATE) if cfg.AFFINE_TRANSLATE > 0 else None
        ops.append(
            T.RandomAffine(
                degrees=cfg.AFFINE_DEGREES,
                translate=translate,
                scale=(lo, hi),
                shear=cfg.AFFINE_SHEAR or None,
                interpolation=T.InterpolationMode.BILINEAR,
            )
        )
    if cfg.ELASTIC_PROB > 0 and cfg.ELASTIC_ALPHA > 0:
        elastic = T.ElasticTransform(alpha=float(cfg.ELASTIC_ALPHA), sigma=float(cfg.ELASTIC_SIGMA))
        ops.append(T.RandomApply([elastic], p=cfg.ELASTIC_PROB))
    return ops


def ssl_view_transform(cfg, size: int, scale: Sequence[float]) -> Callable[[Image.Image], torch.Tensor]:
    """One augmented view: PIL RGB image -> float32 tensor (3, size, size)."""
    ops: List[Callable] = geometric_ops(cfg) + [T.RandomResizedCrop(size, scale=tuple(scale))]
    if cfg.HORIZONTAL_FLIP > 0:
        ops.append(T.RandomHorizontalFlip(p=cfg.HORIZONTAL_FLIP))
    if cfg.VERTICAL_FLIP > 0:
        ops.append(T.RandomVerticalFlip(p=cfg.VERTICAL_FLIP))
    if cfg.ROTATE_90 > 0:
        ops.append(RandomRotate90(cfg.ROTATE_90))
    strength = cfg.COLOR_DISTORTION
    if strength > 0:
        jitter = T.ColorJitter(0.8 * strength, 0.8 * strength, 0.8 * strength, 0.2 * strength)
        ops += [T.RandomApply([jitter], p=0.8), T.RandomGrayscale(p=0.2)]
    if cfg.BLUR_PROB > 0:
        ops.append(T.RandomApply([GaussianBlurPIL(cfg.BLUR_RADIUS)], p=cfg.BLUR_PROB))
    if cfg.SOLARIZE_PROB > 0:
        ops.append(T.RandomSolarize(threshold=128, p=cfg.SOLARIZE_PROB))
    return T.Compose(ops + _normalize(cfg))


class MultiCropTransform:
    """PIL image -> list of NUM_CROPS[0] views of SIZE_CROPS[0], then NUM_CROPS[1] of SIZE_CROPS[1]..."""

    def __init__(self, cfg):
        _check_multicrop(cfg)
        self.views: List[Callable] = []
        for count, size, scale in zip(cfg.NUM_CROPS, cfg.SIZE_CROPS, cfg.CROP_SCALES):
            view = ssl_view_transform(cfg, size, scale)
            self.views += [view] * count

    def __call__(self, image: Image.Image) -> List[torch.Tensor]:
        return [view(image) for view in self.views]


class EvalTransform:
    """PIL image -> [float32 tensor (3, CENTER_CROP, CENTER_CROP)]: resize the shorter side, crop the centre."""

    def __init__(self, cfg):
        if cfg.RESIZE < cfg.CENTER_CROP:
            raise ValueError(f"TRANSFORMS.RESIZE ({cfg.RESIZE}) must be >= CENTER_CROP ({cfg.CENTER_CROP})")
        self.transform = T.Compose([T.Resize(cfg.RESIZE), T.CenterCrop(cfg.CENTER_CROP)] + _normalize(cfg))

    def __call__(self, image: Image.Image) -> List[torch.Tensor]:
        return [self.transform(image)]


TRANSFORMS: Dict[str, Callable] = {"multicrop": MultiCropTransform, "eval": EvalTransform}


def build_transform(transforms_cfg) -> Callable[[Image.Image], List[torch.Tensor]]:
    """Build the transform named ``transforms_cfg.NAME`` from ``DATA.<split>.TRANSFORMS``."""
    name = transforms_cfg.NAME
    if name not in TRANSFORMS:
        raise ValueError(f"unknown TRANSFORMS.NAME {name!r}; valid names: {sorted(TRANSFORMS)}")
    return TRANSFORMS[name](transforms_cfg)
