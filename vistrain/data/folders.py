"""Reading image folders and file lists: which files, with which labels.

``disk_folder`` reads one of two layouts (``DATA.<split>.FOLDER_LABELS``):

* ``subfolders``: ImageFolder, ``<path>/<class>/**/<image>``; labels are the indices of the sorted
  class folder names.
* ``none``: every image below ``<path>``, flat or nested, label -1 (unlabelled: what a user has for
  pretraining; solo-learn's ``no_labels``). Evaluation refuses such a split in one line.
* ``auto`` (default): ``none`` when ``<path>`` holds images itself (a flat folder), else
  ``subfolders``.

Linked folders are followed, but every real folder is read once (a symlink loop is walked once).

8-bit decoding (:func:`decode_8bit`, for ``vistrain/data/pixels.py``): a JPEG is decoded by
``torchvision.io.decode_jpeg`` (libjpeg-turbo: PIL's pixels, faster on a core:
``dev/bench/bench_pipeline.py``), or at 1/2, 1/4 or 1/8 of its size by PIL's ``draft`` (the JPEG's
own DCT scaling) where the views still get at least as many source pixels as they have (the bound
``fits`` comes from the views, :func:`draft_fits`); other images by PIL (:func:`read_image`).
"""

import io
import logging
import math
import os
from typing import Callable, Iterator, List, NamedTuple, Optional, Set, Tuple, Union

import numpy as np
import torch
from PIL import Image, UnidentifiedImageError
from torchvision.datasets.folder import IMG_EXTENSIONS
from torchvision.io import ImageReadMode, decode_jpeg

from vistrain.config.errors import ConfigError, DataError
from vistrain.config.words import plural
from vistrain.distributed import comm

logger = logging.getLogger(__name__)
FOLDER_LABELS = ("auto", "subfolders", "none")
UNLABELLED = -1  # the label of an image that has none
IMAGE_SUFFIXES = IMG_EXTENSIONS + (".npy",)  # torchvision's, and NumPy arrays (vistrain/data/pixels.py)


class CorruptImageError(DataError):
    """An image file cannot be read (missing, truncated, not an image); the message names the file."""


JPEG_START = b"\xff\xd8\xff"  # the first bytes of every JPEG file
DRAFT_SCALES = (8, 4, 2)  # the reductions a JPEG decoder can make in the DCT domain
CROP_RATIO = (3 / 4, 4 / 3)  # the aspect range of the random resized crop (``views.crop_boxes``)
Fits = Callable[[int, int], bool]  # (height, width) of a decoded image -> do the views get enough pixels
Name = Union[str, Callable[[], str]]  # what an error calls the image


def read_image(path: str, mode: str = "RGB", fits: Optional[Fits] = None) -> Image.Image:
    """Decode ``path`` fully into a PIL image of ``mode`` (truncated files fail here, not later); a
    JPEG at reduced size where ``fits`` allows (:func:`draft_scale`)."""
    try:
        with open(path, "rb") as handle:
            return _pil_decode(handle, path, mode, fits)
    except FileNotFoundError:
        raise CorruptImageError(f"image file not found: {path}") from None


class EncodedJpeg(NamedTuple):
    """A JPEG left undecoded, that :func:`decode_8bit` would decode by torchvision.io at full size
    (``DATA.<split>.DECODE_ON_DEVICE``): its bytes ``data`` (uint8 (n,), CPU), ``mode`` ("RGB" or
    "L"), ``shape`` (C, H, W) of the decoded image (from the header: C = 3 for "RGB", 1 for "L")
    and ``name`` (the file's, for messages)."""

    data: torch.Tensor
    mode: str
    shape: Tuple[int, int, int]
    name: str

    def decode(self) -> np.ndarray:
        """On the CPU, as :func:`decode_8bit` decodes it: uint8 (H, W, 3) or (H, W)."""
        return _torchvision_decode(self.data, self.mode, self.name)


def read_8bit(
    path: str, mode: str = "RGB", fits: Optional[Fits] = None, keep_jpeg: bool = False
) -> np.ndarray:
    """Decode the file ``path`` as :func:`decode_8bit` does."""
    try:
        with open(path, "rb") as handle:
            data = bytearray(handle.read())
    except FileNotFoundError:
        raise CorruptImageError(f"image file not found: {path}") from None
    except OSError as err:
        raise CorruptImageError(f"cannot read image {path}: {err}") from None
    return decode_8bit(data, mode, fits, path, keep_jpeg)


def decode_8bit(
    data: bytearray, mode: str = "RGB", fits: Optional[Fits] = None, name: Name = "", keep_jpeg: bool = False
) -> Union[np.ndarray, EncodedJpeg]:
    """An image file's bytes -> uint8 (H, W, 3) RGB (``mode`` "RGB") or (H, W) grayscale ("L"): a
    JPEG by torchvision.io (the array may then be a view of channel-first memory), or at reduced
    size where ``fits`` allows; other files by PIL. Unreadable data raises CorruptImageError naming
    ``name`` (the file; a callable is called only then). ``keep_jpeg``: a JPEG that torchvision.io
    would decode comes back undecoded, an :class:`EncodedJpeg` (its header read, not its data)."""
    size = _full_size_jpeg(data, mode, fits) if data[:3] == JPEG_START and mode in ("RGB", "L") else None
    if size is None:
        return np.array(_pil_decode(io.BytesIO(data), name, mode, fits))
    encoded = torch.frombuffer(data, dtype=torch.uint8)
    if keep_jpeg:
        return EncodedJpeg(encoded, mode, (3 if mode == "RGB" else 1, *size), _named(name))
    return _torchvision_decode(encoded, mode, name)


def _torchvision_decode(data: torch.Tensor, mode: str, name: Name) -> np.ndarray:
    try:
        pixels = decode_jpeg(data, mode=_READ_MODES[mode])
    except RuntimeError as err:
        raise CorruptImageError(f"cannot read image {_named(name)}: {jpeg_error(err)}") from None
    return pixels.permute(1, 2, 0).squeeze(2).numpy()


def jpeg_error(err: RuntimeError) -> str:
    """torchvision.io's message without the C++ file and line it starts with."""
    return str(err).rsplit(", ", 1)[-1]


def _named(name: Name) -> str:
    return name() if callable(name) else name


_READ_MODES = {"RGB": ImageReadMode.RGB, "L": ImageReadMode.GRAY}


def _full_size_jpeg(data: bytearray, mode: str, fits: Optional[Fits]) -> Optional[Tuple[int, int]]:
    """(H, W) when torchvision.io decodes this JPEG: an 8-bit RGB or grayscale one (CMYK and others
    go to PIL's conversions) that is not to be decoded at reduced size; else None."""
    try:
        with Image.open(io.BytesIO(data)) as header:  # reads the header only
            kind, (width, height) = header.mode, header.size
    except Exception:  # PIL names what is wrong with the file
        return None
    if kind != mode and not (kind == "L" and mode == "RGB"):
        return None
    return (height, width) if fits is None or draft_scale(width, height, fits) == 1 else None


def draft_scale(width: int, height: int, fits: Fits) -> int:
    """The largest s of 8, 4, 2 with ``fits(height // s, width // s)``, else 1. PIL's ``draft`` with
    that size decodes a JPEG at ceil(side / s), at least the sizes ``fits`` accepted."""
    for scale in DRAFT_SCALES:
        if height // scale > 0 and width // scale > 0 and fits(height // scale, width // scale):
            return scale
    return 1


def draft_fits(cfg) -> Optional[Callable[[int, int], bool]]:
    """The bound for decoding an image at reduced size (:func:`draft_scale`) from the views of
    ``DATA.<split>.TRANSFORMS`` (``vistrain/data/transforms.py``): ``fits(H, W)``
    is True when every view of an H x W image still gets at least as many source pixels as it
    has, along each side. None when an affine or elastic step comes first (decode at full size).

    multicrop: a crop of scale range [lo, hi] has area A >= lo H W and aspect w / h in [3/4, 4/3],
    so both sides are at least sqrt(3/4 A) >= sqrt(3/4 lo H W); when none of its attempts fits,
    it is the whole image cut to that aspect, sides >= min(H, W). So, for every resolution i:
    sqrt(3/4 lo_i H W) >= SIZE_CROPS[i] and min(H, W) >= SIZE_CROPS[i]. eval: min(H, W) >= RESIZE
    (the resize of the shorter side to RESIZE then only shrinks).
    """
    if cfg.NAME == "eval":
        return lambda height, width: min(height, width) >= cfg.RESIZE
    affine = cfg.AFFINE_DEGREES > 0 or cfg.AFFINE_TRANSLATE > 0 or cfg.AFFINE_SHEAR > 0
    if affine or list(cfg.AFFINE_SCALE) != [1.0, 1.0] or (cfg.ELASTIC_PROB > 0 and cfg.ELASTIC_ALPHA > 0):
        return None
    needs = [(float(scale[0]), int(size)) for size, scale in zip(cfg.SIZE_CROPS, cfg.CROP_SCALES)]
    smallest = min(CROP_RATIO)  # the narrowest aspect RandomResizedCrop draws

    def fits(height: int, width: int) -> bool:
        return all(
            math.sqrt(smallest * lo * height * width) >= size and min(height, width) >= size
            for lo, size in needs
        )

    return fits


def _pil_decode(handle, path: Name, mode: str, fits: Optional[Fits]) -> Image.Image:
    try:
        image = Image.open(handle)
        if fits is not None and image.format == "JPEG":
            scale = draft_scale(*image.size, fits)
            if scale > 1:
                image.draft(None, (image.size[0] // scale, image.size[1] // scale))
        return image.convert(mode)  # convert() forces the full decode
    except UnidentifiedImageError:  # its message names a file handle, not the file
        raise CorruptImageError(f"cannot read image {_named(path)}: not an image format PIL knows") from None
    except (OSError, SyntaxError, ValueError, Image.DecompressionBombError) as err:
        raise CorruptImageError(f"cannot read image {_named(path)}: {err}") from None


def is_image(name: str) -> bool:
    return name.lower().endswith(IMAGE_SUFFIXES)


def pick_split_folder(path: str, split: str) -> str:
    """``path/split`` when ``path`` holds both ``train/`` and ``val/``, else ``path``."""
    if not os.path.isdir(path):
        raise DataError(f"disk_folder: folder not found: {path}")
    subdirs = sorted(e.name for e in os.scandir(path) if e.is_dir())
    if "train" in subdirs and "val" in subdirs:
        if split not in subdirs:
            raise ConfigError(
                f"disk_folder: {path} has split folders {subdirs}; SPLIT {split!r} is not one of them"
            )
        return os.path.join(path, split)
    return path


def scan_disk_folder(root: str, mode: str = "auto") -> Tuple[List[str], List[int]]:
    """(image paths, labels) of ``root`` read as ``mode`` (see the module docstring); sorted order."""
    if mode not in FOLDER_LABELS:
        raise ConfigError(f"FOLDER_LABELS {mode!r} is not one of {list(FOLDER_LABELS)}")
    if mode == "auto":
        mode = "none" if any(e.is_file() and is_image(e.name) for e in os.scandir(root)) else "subfolders"
    if mode == "none":
        paths = scan_unlabelled(root)
        return paths, [UNLABELLED] * len(paths)
    paths, labels, _ = scan_image_folder(root)
    return paths, labels


def scan_unlabelled(root: str) -> List[str]:
    """Every image file below ``root`` (any depth, links followed, each real folder once), sorted."""
    paths, repeated = [], []
    for folder, files in _walk_once(root, set(), repeated):
        paths += [os.path.join(folder, f) for f in sorted(files) if is_image(f)]
    _warn_repeated(repeated, root)
    if not paths:
        raise DataError(f"disk_folder: no images ({', '.join(IMAGE_SUFFIXES)}) under {root}")
    return paths


def scan_image_folder(root: str) -> Tuple[List[str], List[int], List[str]]:
    """ImageFolder scan: (image paths, labels, class names), classes and files in sorted order.

    Linked folders are followed, but every real folder is read once: a link back up the tree
    (``cls/loop -> .``) or a second link to a folder already read is skipped, so no image is
    counted twice. Global rank 0 of a running job says so in one warning (the launcher's check
    counts the same folders first, and every rank reads them again).
    """
    classes = sorted(e.name for e in os.scandir(root) if e.is_dir() and not e.name.startswith("."))
    if not classes:
        raise DataError(
            f"disk_folder: no class subfolders in {root}; for unlabelled images set FOLDER_LABELS=none"
        )
    paths, labels, seen, repeated = [], [], set(), []
    for label, name in enumerate(classes):
        for folder, files in _walk_once(os.path.join(root, name), seen, repeated):
            for file in sorted(files):
                if is_image(file):
                    paths.append(os.path.join(folder, file))
                    labels.append(label)
    _warn_repeated(repeated, root)
    if not paths:
        raise DataError(f"disk_folder: no images ({', '.join(IMAGE_SUFFIXES)}) under {root}")
    return paths, labels, classes


def _warn_repeated(repeated: List[str], root: str) -> None:
    if repeated and comm.is_dist() and comm.is_main_process():
        logger.warning(
            f"disk_folder: skipped {plural(len(repeated), 'linked folder')} under {root} already read "
            f"through another path (a symlink loop or a repeated link), e.g. {repeated[0]}"
        )


def _walk_once(top: str, seen: Set[Tuple[int, int]], repeated: List[str]) -> Iterator[Tuple[str, List[str]]]:
    """(folder, file names) of ``top`` and the folders below it, links followed, each real folder
    (device, inode) once across calls sharing ``seen``; folders skipped as repeats go to ``repeated``."""
    if not _first_visit(top, seen):
        repeated.append(top)
        return
    for folder, dirs, files in os.walk(top, followlinks=True):
        kept = []
        for name in sorted(dirs):
            if _first_visit(os.path.join(folder, name), seen):
                kept.append(name)
            else:
                repeated.append(os.path.join(folder, name))
        dirs[:] = kept  # os.walk descends only into these
        yield folder, files


def _first_visit(folder: str, seen: Set[Tuple[int, int]]) -> bool:
    try:
        stat = os.stat(folder)  # follows links: the real folder's identity
    except OSError:  # a dangling link: nothing to read
        return False
    key = (stat.st_dev, stat.st_ino)
    if key in seen:
        return False
    seen.add(key)
    return True


def read_filelist(list_path: str) -> Tuple[List[str], List[int]]:
    """Parse ``<path> <label>`` lines; relative paths are joined to the list file's folder."""
    if not os.path.isfile(list_path):
        raise DataError(f"disk_filelist: file list not found: {list_path}")
    base = os.path.dirname(os.path.abspath(list_path))
    paths, labels = [], []
    with open(list_path) as handle:
        for lineno, line in enumerate(handle, 1):
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            parts = line.rsplit(None, 1)  # the path itself may contain spaces
            if len(parts) != 2 or not parts[1].lstrip("-").isdigit():
                raise DataError(f"{list_path}:{lineno}: expected '<path> <integer label>', got {line!r}")
            paths.append(os.path.join(base, os.path.expanduser(parts[0])))
            labels.append(int(parts[1]))
    if not paths:
        raise DataError(f"disk_filelist: {list_path} lists no images")
    return paths, labels
