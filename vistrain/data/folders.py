"""Reading image folders and file lists: which files, with which labels.

``disk_folder`` reads one of two layouts (``DATA.<split>.FOLDER_LABELS``):

* ``subfolders``: ImageFolder, ``<path>/<class>/**/<image>``; labels are the indices of the sorted
  class folder names.
* ``none``: every image below ``<path>``, flat or nested, label -1 (unlabelled: what a user has for
  pretraining; solo-learn's ``no_labels``). Evaluation refuses such a split in one line.
* ``auto`` (default): ``none`` when ``<path>`` holds images itself (a flat folder), else
  ``subfolders``.

Linked folders are followed, but every real folder is read once (a symlink loop is walked once).
"""

import logging
import os
from typing import Iterator, List, Set, Tuple

from PIL import Image, UnidentifiedImageError
from torchvision.datasets.folder import IMG_EXTENSIONS

from vistrain.config.errors import ConfigError, DataError
from vistrain.config.words import plural
from vistrain.distributed import comm

logger = logging.getLogger(__name__)
FOLDER_LABELS = ("auto", "subfolders", "none")
UNLABELLED = -1  # the label of an image that has none
IMAGE_SUFFIXES = IMG_EXTENSIONS + (".npy",)  # torchvision's, and NumPy arrays (vistrain/data/pixels.py)


class CorruptImageError(DataError):
    """An image file cannot be read (missing, truncated, not an image); the message names the file."""


def read_image(path: str, mode: str = "RGB") -> Image.Image:
    """Decode ``path`` fully into a PIL image of ``mode`` (truncated files fail here, not later)."""
    try:
        with open(path, "rb") as handle:
            return Image.open(handle).convert(mode)  # convert() forces the full decode
    except FileNotFoundError:
        raise CorruptImageError(f"image file not found: {path}") from None
    except UnidentifiedImageError:  # its message names a file handle, not the file
        raise CorruptImageError(f"cannot read image {path}: not an image format PIL knows") from None
    except (OSError, SyntaxError, ValueError, Image.DecompressionBombError) as err:
        raise CorruptImageError(f"cannot read image {path}: {err}") from None


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
