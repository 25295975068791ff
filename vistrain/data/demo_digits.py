"""The bundled demo data set: scikit-learn's 1,797 real 8x8 handwritten digits as PNG files on disk.

``ensure_demo_digits(cache_dir)`` writes, once, ``<cache_dir>/demo_digits/{train,val}/<digit>/<id>.png``
(32x32 RGB, bilinear upscaling of the 0..16 grey levels to 0..255) with a stratified 80/20 split
(``train_test_split(..., stratify=labels, random_state=0)``: 1,437 train and 360 val images), and
returns that folder. The trainer then reads it through the ordinary ``disk_folder`` code.

Crash and concurrency safety:
* The set is written into a fresh temporary sibling folder and published with one ``os.rename``;
  a folder named ``demo_digits`` is therefore always complete (a crash leaves only a ``.tmp-``
  folder, ignored and removed later). ``META.json`` inside records what was written.
* Writers serialise on an ``fcntl`` lock file next to the folder, so concurrent ranks on one
  machine write it once and the others wait. Where the lock is unavailable (or ineffective,
  e.g. some network file systems) several writers may each build a temporary copy; the first
  rename wins and the rest discard theirs, which is harmless.
* In a distributed job ``ensure_demo_digits_on_every_node`` lets only local rank 0 of each machine
  write (a node-local cache gets one copy per node, a shared one a single copy: the rename above
  settles races between nodes) while the other ranks wait, then every rank reads the finished set.
"""

import json
import math
import os
import shutil
import time
import uuid
from contextlib import contextmanager

import numpy as np
from PIL import Image

from vistrain.config.errors import ConfigError
from vistrain.data.digits_source import SPLIT_SEED, VAL_FRACTION, read_digits
from vistrain.distributed import comm

try:
    import fcntl
except ImportError:  # not POSIX: rely on the atomic rename alone
    fcntl = None

DEMO_NAME = "demo_digits"
IMAGE_SIDE = 32
NUM_IMAGES = 1797
_STALE_TMP_SECONDS = 3600  # a temporary folder this old belongs to a crashed writer


def default_cache_dir(cache_dir: str = "") -> str:
    """``DATA.CACHE_DIR``, or ``~/.cache/vistrain`` when it is empty."""
    return os.path.expanduser(cache_dir) if cache_dir else os.path.expanduser("~/.cache/vistrain")


def demo_digits_root(cache_dir: str = "") -> str:
    return os.path.join(default_cache_dir(cache_dir), DEMO_NAME)


def demo_split_size(split: str) -> int:
    """Images of ``split`` ("train" 1,437 or "val" 360), known without writing the set:
    ``train_test_split`` puts ceil(VAL_FRACTION x NUM_IMAGES) images in val."""
    val = math.ceil(VAL_FRACTION * NUM_IMAGES)
    sizes = {"train": NUM_IMAGES - val, "val": val}
    if split not in sizes:
        raise ConfigError(f"demo_digits: SPLIT must be 'train' or 'val', got {split!r}")
    return sizes[split]


def _is_complete(root: str) -> bool:
    return os.path.isfile(os.path.join(root, "META.json"))


@contextmanager
def _file_lock(path: str):
    if fcntl is None:
        yield
        return
    with open(path, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)  # released by the OS if this process dies
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _digit_to_image(pixels: np.ndarray) -> Image.Image:
    """(8, 8) float grey levels in [0, 16] -> RGB PIL image (IMAGE_SIDE, IMAGE_SIDE)."""
    grey = np.clip(pixels * (255.0 / 16.0), 0, 255).round().astype(np.uint8)
    image = Image.fromarray(grey).resize((IMAGE_SIDE, IMAGE_SIDE), Image.Resampling.BILINEAR)
    return image.convert("RGB")


def write_demo_digits(folder: str) -> dict:
    """Write the whole set into ``folder`` (which must not exist). Returns the metadata."""
    images, labels, splits = read_digits()  # in a child process (see digits_source.py)
    for split, ids in splits.items():
        for digit in range(10):
            os.makedirs(os.path.join(folder, split, str(digit)))
        for i in ids:
            path = os.path.join(folder, split, str(int(labels[i])), f"{i:04d}.png")
            _digit_to_image(images[i]).save(path, compress_level=1)  # tiny files: speed over size
    meta = {
        "source": "sklearn.datasets.load_digits",
        "image_side": IMAGE_SIDE,
        "split_seed": SPLIT_SEED,
        "counts": {split: len(ids) for split, ids in splits.items()},
    }
    with open(os.path.join(folder, "META.json"), "w") as handle:
        json.dump(meta, handle, indent=1)
    return meta


def _remove_stale_tmp(parent: str) -> None:
    now = time.time()
    for entry in os.scandir(parent):
        if entry.name.startswith(f".{DEMO_NAME}.tmp-") and now - entry.stat().st_mtime > _STALE_TMP_SECONDS:
            shutil.rmtree(entry.path, ignore_errors=True)


def _publish(tmp: str, root: str) -> None:
    """Atomically move the finished ``tmp`` folder to ``root``; losing a race to another writer is fine."""
    try:
        os.rename(tmp, root)
    except OSError:
        if not _is_complete(root):
            raise
        shutil.rmtree(tmp, ignore_errors=True)  # another process published first


def ensure_demo_digits_on_every_node(cache_dir: str = "") -> str:
    """Collective ``ensure_demo_digits``: written by local rank 0 of every node, read by all ranks.

    A failure on any node raises on every rank (nobody is left waiting at the barrier).
    """
    error = None
    if comm.get_local_rank() == 0:
        try:
            ensure_demo_digits(cache_dir)
        except Exception as exc:
            error = f"rank {comm.get_rank()}: {type(exc).__name__}: {exc}"
    errors = [e for e in comm.all_gather_object(error) if e]  # doubles as the barrier
    if errors:
        raise RuntimeError(f"preparing the demo data failed ({errors[0]})")
    return ensure_demo_digits(cache_dir)  # complete on this node by now: only checks META.json


def ensure_demo_digits(cache_dir: str = "") -> str:
    """Create the demo set under ``cache_dir`` unless it is already there; return its folder.

    Idempotent and safe to call from every rank at once (see the module docstring).
    """
    root = demo_digits_root(cache_dir)
    if _is_complete(root):
        return root
    parent = os.path.dirname(root)
    os.makedirs(parent, exist_ok=True)
    with _file_lock(os.path.join(parent, f".{DEMO_NAME}.lock")):
        if _is_complete(root):  # written by whoever held the lock before us
            return root
        if os.path.exists(root):
            raise RuntimeError(
                f"{root} exists but is not a complete demo_digits set (no META.json); remove it"
            )
        _remove_stale_tmp(parent)
        tmp = os.path.join(parent, f".{DEMO_NAME}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}")
        try:
            write_demo_digits(tmp)
            _publish(tmp, root)
        finally:
            if os.path.exists(tmp):
                shutil.rmtree(tmp, ignore_errors=True)
    return root
