"""Images that are not 8-bit RGB: reading them, fitting their channels to the views', scaling
their values to [0, 1], and per-channel statistics for the normalisation.

Reading (:func:`read_pixels`), by file suffix:

* ``.npy``: a NumPy array (H, W) or (H, W, C) of any integer or float dtype, read as it is.
* ``.png``: 8-bit images as every other format (``read_image``: converted by PIL to the source's
  mode, RGB or L); 16-bit grey as uint16 (H, W) (PIL's ``I;16``), 16-bit colour as uint16
  (H, W, 3) (``torchvision.io.decode_png``; alpha dropped, as PIL's RGB conversion drops it).
* ``.tif`` / ``.tiff``: one frame of at most 4 samples of at most 8 bits through PIL (its mode
  conversions: palette, CMYK, YCbCr, 1-bit); one band of 16-bit integers or 32-bit floats through
  PIL as it is; anything else (more than 4 bands, 16-bit colour, several pages, band-interleaved
  layouts) through ``tifffile`` (``pip install "vistrain[tiff]"``), its first series as
  (H, W) or (H, W, C).

Channels (:func:`fit_channels`): the views have ``DATA.CHANNELS`` channels (C). An image of C
channels is kept; a one-channel image is kept for C = 3 (its views are made on the one channel and
repeated last, a third of the work); a 3-channel image is made grey for C = 1 by PIL's integer luma
(R 19595 + G 38470 + B 7471 + 32768) >> 16 (exact on grey images saved as RGB); any other pair is a
one-line DataError naming DATA.CHANNELS.

Scaling (:func:`to_unit`): x -> (x - low) / (high - low) clipped to [0, 1], [low, high] the
configured ``DATA.<split>.PIXEL_RANGE`` or, when it is empty, the dtype's range (uint8 [0, 255],
uint16 [0, 65535], int16 [-32768, 32767], floats [0, 1]).

Normalisation (:func:`fit_normalization`, :func:`channel_stats`): MEAN and STD of C values, one for
all, or three averaged for grey views; or the per-channel mean and std of a sample of the images.
"""

import io
import os
from typing import BinaryIO, Callable, List, Optional, Sequence, Tuple, Union

import numpy as np
import torch
from PIL import Image, UnidentifiedImageError

from vistrain.config.errors import ConfigError, DataError
from vistrain.data.folders import (
    JPEG_START,
    CorruptImageError,
    EncodedJpeg,
    Fits,
    decode_8bit,
    read_8bit,
    read_image,
)

NATIVE_MODES = ("I;16", "I;16B", "I;16L", "I;16N", "I", "F")  # PIL modes read as they are (one band)
LUMA = (19595, 38470, 7471)  # PIL's RGB -> L weights, in 1/65536
NPY_MAGIC = b"\x93NUMPY"
TIFF_MAGIC = (b"II*\x00", b"MM\x00*", b"II+\x00", b"MM\x00+")  # little / big endian, classic / BigTIFF


def read_pixels(
    path: str, mode: str = "RGB", fits: Optional[Fits] = None, keep_jpeg: bool = False
) -> Union[np.ndarray, EncodedJpeg]:
    """The image at ``path`` as an array (H, W) or (H, W, C) of its own dtype (see the module
    docstring); 8-bit images PIL reads as PIL converts them to ``mode`` (uint8), JPEGs by
    ``folders.read_8bit`` (torchvision.io, or at reduced size where the views' bound ``fits``
    allows; with ``keep_jpeg`` those torchvision.io would decode are left encoded). Unreadable
    files raise CorruptImageError naming the file."""
    suffix = os.path.splitext(path)[1].lower()
    if suffix == ".npy":
        return _npy(path, path)
    if suffix in (".png", ".tif", ".tiff"):
        return _deep(path, path, mode)
    return read_8bit(path, mode, fits, keep_jpeg)


def decode_pixels(
    data: bytes, name: Union[str, Callable[[], str]], mode: str = "RGB", fits: Optional[Fits] = None
) -> np.ndarray:
    """:func:`read_pixels` of a file's bytes, the format found from them. ``name``: the file's, for
    messages, or a function giving it (called only when a message is written)."""
    if callable(name):
        name = _LazyName(name)
    if data.startswith(JPEG_START):
        return decode_8bit(bytearray(data), mode, fits, name)
    if data.startswith(NPY_MAGIC):
        return _npy(io.BytesIO(data), name)
    return _deep(data, name, mode)


class _LazyName:
    """A name computed when a message formats it (a shard member's name reads the shard's index)."""

    def __init__(self, get: Callable[[], str]):
        self.get = get

    def __format__(self, spec: str) -> str:
        return format(self.get(), spec)

    def __str__(self) -> str:
        return self.get()


def _npy(source: Union[str, BinaryIO], name: str) -> np.ndarray:
    try:
        array = np.load(source, allow_pickle=False)
    except FileNotFoundError:
        raise CorruptImageError(f"image file not found: {name}") from None
    except (OSError, ValueError, EOFError) as err:
        raise CorruptImageError(f"cannot read array {name}: {err}") from None
    return checked_array(array, name)


def checked_array(array: np.ndarray, name: str) -> np.ndarray:
    """``array`` in native byte order; CorruptImageError unless (H, W) / (H, W, C) of numbers."""
    numbers = np.issubdtype(array.dtype, np.integer) or np.issubdtype(array.dtype, np.floating)
    if array.ndim not in (2, 3) or not numbers:
        raise CorruptImageError(
            f"{name}: an image must be an (H, W) or (H, W, C) array of numbers, got {array.dtype} {array.shape}"
        )
    return array.astype(array.dtype.newbyteorder("="), copy=False)


def _deep(source: Union[str, bytes], name: str, mode: str) -> np.ndarray:
    """A PNG or TIFF (or any image PIL reads), ``source`` its path or bytes: see the module
    docstring. 8-bit files are decoded by ``read_image``, as every other image file."""
    tiff = source.startswith(TIFF_MAGIC) if isinstance(source, bytes) else not source.lower().endswith(".png")
    try:
        with Image.open(io.BytesIO(source) if isinstance(source, bytes) else source) as image:
            how = _how(image)
            if how == "convert" and isinstance(source, bytes):
                return np.array(image.convert(mode))  # convert() forces the full decode
            if how == "native":
                return checked_array(np.array(image), name)
    except FileNotFoundError:
        raise CorruptImageError(f"image file not found: {name}") from None
    except UnidentifiedImageError:  # its message names a file handle, not the file
        if not tiff:
            raise CorruptImageError(f"cannot read image {name}: not an image format PIL knows") from None
        how = "tifffile"
    except (OSError, SyntaxError, ValueError, Image.DecompressionBombError) as err:
        if not tiff:
            raise CorruptImageError(f"cannot read image {name}: {err}") from None
        how = "tifffile"  # PIL could not decode it: tifffile may
    if how == "convert":
        return np.array(read_image(source, mode))
    return _png16(source, name) if how == "png16" else _tifffile(source, name)


def _how(image: Image.Image) -> str:
    """How to read an opened image: "convert" (PIL's 8-bit conversions), "native" (PIL's array of
    one band as it is), "png16" (16-bit colour PNG) or "tifffile"."""
    if image.format == "TIFF":
        samples, bits = image.tag_v2.get(277, 1), image.tag_v2.get(258, (8,))
        bits = bits if isinstance(bits, tuple) else (bits,)
        if getattr(image, "n_frames", 1) != 1:
            return "tifffile"
        if samples <= 4 and max(bits) <= 8:
            return "convert"
        return "native" if samples == 1 and image.mode in NATIVE_MODES else "tifffile"
    if image.mode in NATIVE_MODES:
        return "native"
    if image.format == "PNG" and image.mode in ("RGB", "RGBA") and ";16" in _rawmode(image):
        return "png16"
    return "convert"


def _rawmode(image: Image.Image) -> str:
    if not image.tile:
        return ""
    args = image.tile[0].args
    return args if isinstance(args, str) else str(args[0])


def _png16(source: Union[str, bytes], name: str) -> np.ndarray:
    """A 16-bit colour PNG as uint16 (H, W, 3) (torchvision's decoder keeps the 16 bits; alpha dropped)."""
    from torchvision.io import ImageReadMode, decode_png, read_file

    try:
        data = (
            read_file(source)
            if isinstance(source, str)
            else torch.frombuffer(bytearray(source), dtype=torch.uint8)
        )
        pixels = decode_png(data, ImageReadMode.UNCHANGED)
    except RuntimeError as err:
        raise CorruptImageError(f"cannot read image {name}: {str(err).splitlines()[0]}") from None
    return pixels[:3].permute(1, 2, 0).numpy()


def _tifffile(source: Union[str, bytes], name: str) -> np.ndarray:
    """The first series of a TIFF as (H, W) or (H, W, C), band-interleaved layouts (C, H, W) moved."""
    try:
        import tifffile
    except ImportError:
        raise ConfigError(
            f'reading {name} (more bands or bits than PIL reads) needs tifffile: pip install "vistrain[tiff]"'
        ) from None
    try:
        with tifffile.TiffFile(io.BytesIO(source) if isinstance(source, bytes) else source) as tif:
            series = tif.series[0]
            array, axes = series.asarray(), series.axes
    except FileNotFoundError:
        raise CorruptImageError(f"image file not found: {name}") from None
    except Exception as err:  # tifffile raises many kinds (TiffFileError, ValueError, struct.error...)
        raise CorruptImageError(f"cannot read image {name}: {err}") from None
    if array.ndim == 3 and axes.endswith("YX"):  # bands first (planar): channels last
        array = np.moveaxis(array, 0, -1)
    return checked_array(array, name)


# -------------------------------------------------------------------------------------- channels
def channels_of(image: np.ndarray) -> int:
    return 1 if image.ndim == 2 else image.shape[2]


def fit_channels(image: np.ndarray, channels: int) -> np.ndarray:
    """``image`` (H, W) or (H, W, c) for views of ``channels`` channels (module docstring): kept,
    or made grey (3 -> 1, PIL's luma). DataError (one line, without the file) for other pairs."""
    have = channels_of(image)
    if have == channels or (have == 1 and channels == 3):
        return image
    if have == 3 and channels == 1:
        return luma(image)
    raise DataError(
        f"an image of {have} channels, but the views have DATA.CHANNELS={channels}: set "
        f"MODEL.TRUNK.IN_CHANNELS={have} (DATA.CHANNELS follows it unless set)"
    )


def luma(image: np.ndarray) -> np.ndarray:
    """(H, W, 3) -> (H, W) grey of the same dtype: PIL's ``convert("L")`` for integers, rounded
    (R 19595 + G 38470 + B 7471 + 32768) >> 16; 0.299 R + 0.587 G + 0.114 B for floats."""
    if np.issubdtype(image.dtype, np.floating):
        return (image @ np.array([0.299, 0.587, 0.114], dtype=image.dtype)).astype(image.dtype)
    weighted = image.astype(np.int64) @ np.array(LUMA, dtype=np.int64)
    return ((weighted + 32768) >> 16).astype(image.dtype)


def fit_normalization(
    mean: Sequence[float],
    std: Sequence[float],
    channels: int,
    computed: Optional[Tuple[Sequence[float], Sequence[float]]] = None,
) -> Tuple[List[float], List[float]]:
    """TRANSFORMS.MEAN and STD (or ``computed`` from the images) as ``channels`` values each: C
    given, one repeated, or for one channel the average of three (a grey image's three equal
    channels). ConfigError (one line) otherwise."""
    fitted = []
    for key, values in zip(("MEAN", "STD"), computed if computed is not None else (mean, std)):
        values = [float(v) for v in values]
        if len(values) == 1:
            values = values * channels
        elif len(values) == 3 and channels == 1:
            values = [sum(values) / 3]
        if len(values) != channels:
            raise ConfigError(
                f"TRANSFORMS.{key} needs DATA.CHANNELS={channels} values (or one for every channel), got "
                f"{len(values)}; or set DATA.NORMALIZE_FROM_IMAGES to compute MEAN and STD from the images"
            )
        fitted.append(values)
    if min(fitted[1]) <= 0:
        raise ConfigError(f"TRANSFORMS.STD must be positive, got {fitted[1]}")
    return fitted[0], fitted[1]


# --------------------------------------------------------------------------------------- scaling
def value_range(dtype: torch.dtype, pixel_range: Optional[Sequence[float]]) -> Tuple[float, float]:
    """[low, high] that maps to [0, 1]: ``pixel_range``, else the dtype's (floats: [0, 1])."""
    if pixel_range:
        return float(pixel_range[0]), float(pixel_range[1])
    if dtype.is_floating_point:
        return 0.0, 1.0
    info = torch.iinfo(dtype)
    return float(info.min), float(info.max)


def keeps_bytes(pixels: torch.Tensor, pixel_range: Optional[Sequence[float]]) -> bool:
    """Whether ``pixels`` go to the views as 8-bit (scaled by 1/255 with the batch, as ever)."""
    return pixels.dtype == torch.uint8 and not pixel_range


def to_unit(pixels: torch.Tensor, pixel_range: Optional[Sequence[float]]) -> torch.Tensor:
    """Any dtype -> float32 in [0, 1]: (x - low) / (high - low), clipped (:func:`value_range`)."""
    low, high = value_range(pixels.dtype, pixel_range)
    return pixels.to(torch.float64).sub_(low).div_(high - low).clamp_(0, 1).to(torch.float32)


def check_pixel_range(pixel_range: Sequence[float]) -> None:
    if pixel_range and (len(pixel_range) != 2 or not pixel_range[0] < pixel_range[1]):
        raise ConfigError(
            f"PIXEL_RANGE must be [] (the dtype's range) or [low, high] with low < high, got {list(pixel_range)}"
        )


# ------------------------------------------------------------------------------------ statistics
def channel_stats(images: Sequence[torch.Tensor], channels: int) -> Tuple[List[float], List[float]]:
    """Per-channel mean and standard deviation over every pixel of ``images`` (each float (c, H, W)
    in [0, 1], c = 1 or ``channels``; a grey image counts for every channel): sums in float64."""
    total = torch.zeros(channels, dtype=torch.float64)
    squares = torch.zeros(channels, dtype=torch.float64)
    count = 0
    for image in images:
        values = image.to(torch.float64).flatten(1)
        total += values.sum(1)
        squares += values.square().sum(1)
        count += values.shape[1]
    mean = total / count
    std = (squares / count - mean.square()).clamp(min=0).sqrt().clamp(min=1e-6)
    return mean.tolist(), std.tolist()
