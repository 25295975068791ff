"""Data sources (flat registry) and the dataset that turns a sample key into augmented views.

Sources (``DATA.<split>.DATA_SOURCES``, one ``DATA_PATHS`` entry each; the entry is ignored by
``synthetic`` and ``demo_digits``). A source's ``load(i)`` gives ``(pixels, label)``: the image as an
array (H, W) or (H, W, C), uint8 for the images PIL converts (RGB or grayscale), the file's own
dtype and bands for 16-bit PNG and TIFF images and ``.npy`` arrays (``vistrain/data/pixels.py``).

* ``disk_folder``: ImageFolder layout ``<path>/<class>/**/<image>``, labels the indices of the
  sorted class folder names; or a flat or nested folder of unlabelled images (label -1), as
  ``FOLDER_LABELS`` says (``vistrain/data/folders.py``). If ``<path>`` holds both ``train/`` and
  ``val/``, ``SPLIT`` picks one.
* ``disk_filelist``: a text file of ``<image path> <integer label>`` lines (blank lines and ``#``
  comments skipped); relative image paths are relative to the list file's folder.
* ``synthetic``: ``SYNTHETIC_SIZE`` deterministic images of ``IMAGE_SIZE`` pixels; sample ``i`` has
  label ``i % SYNTHETIC_NUM_CLASSES`` and is its class's colour blended with noise seeded by
  ``(SPLIT, i)``, so a linear probe can learn something in a dry run.
* ``demo_digits``: scikit-learn's 1,797 digits, written once as PNGs (see ``demo_digits.py``) and
  read like ``disk_folder`` with ``SPLIT`` train (1,437) or val (360), as grayscale, each decoded
  once per process.
* ``elpv``: the solar-cell images of the installed ``elpv-dataset`` package (or a folder of its
  layout in ``DATA_PATHS``), a 75/25 split drawn from ``DATA.SPLIT_SEED``; ``SPLIT`` train or val
  (the 25% test side), or train_fit / train_select inside train for choosing recipes; see ``elpv.py``.
* ``webdataset``: tar shards, ``DATA_PATHS`` a brace pattern such as
  ``/data/shards/train-{000000..000099}.tar``, each shard with the index ``tools/make_shards.py``
  writes; labels from ``cls`` members (-1 without); its epoch rule and resume in ``shards.py``.
* ``hf_dataset``: a Hugging Face ``datasets`` data set on disk (``save_to_disk``, an image folder,
  parquet files), its columns ``HF_IMAGE_COLUMN`` / ``HF_LABEL_COLUMN``; see ``hf_source.py``.

Several sources are concatenated in order, labels kept as each source gives them; ``DATA_LIMIT``
keeps the first N samples of the concatenation. Input that cannot work (a missing or empty folder,
a malformed file list, an unreadable image) is a one-line DataError or ConfigError naming the
file and the key to change.
"""

import bisect
import logging
import os
import zlib
from typing import Callable, Dict, List, Optional, Sequence, Tuple, Union

import numpy as np
import torch
from torch.utils.data import Dataset

from vistrain.config.errors import ConfigError, DataError
from vistrain.data import elpv, shards
from vistrain.data.collate import collate_multicrop
from vistrain.data.demo_digits import demo_split_size, ensure_demo_digits_on_every_node
from vistrain.data.folders import (
    CorruptImageError,
    EncodedJpeg,
    draft_fits,
    pick_split_folder,
    read_filelist,
    scan_disk_folder,
    scan_image_folder,
)
from vistrain.data.hf_source import hf_dataset
from vistrain.data.pixels import fit_channels, read_pixels
from vistrain.data.sampler import mix_seed
from vistrain.data.transforms import build_transform

logger = logging.getLogger(__name__)
MAX_CONSECUTIVE_BAD = 50  # give up when this many images in a row are unreadable


class FileSource:
    """Image files with integer labels: ``load(i) -> (pixels, label)``, pixels a uint8 array
    (H, W, 3) RGB (``mode`` "RGB") or (H, W) grayscale ("L"), or for deeper images and arrays
    their own (``vistrain.data.pixels.read_pixels``). With ``keep_decoded`` each image is
    decoded once per process and kept in memory (small data sets: the demo digits are 1.5 MB).
    ``fits``: the views' bound for decoding JPEGs at reduced size (``folders.draft_scale``)."""

    def __init__(
        self,
        paths: List[str],
        labels: List[int],
        name: str,
        mode: str = "RGB",
        keep_decoded: bool = False,
        fits: Optional[Callable[[int, int], bool]] = None,
    ):
        self.paths, self.labels, self.name, self.mode, self.fits = paths, labels, name, mode, fits
        self._decoded: Optional[Dict[int, np.ndarray]] = {} if keep_decoded else None

    def __len__(self) -> int:
        return len(self.paths)

    def describe(self, i: int) -> str:
        return self.paths[i]

    def load(self, i: int) -> Tuple[np.ndarray, int]:
        pixels = None if self._decoded is None else self._decoded.get(i)
        if pixels is None:
            pixels = read_pixels(self.paths[i], self.mode, self.fits)
            if self._decoded is not None:
                self._decoded[i] = pixels
        return pixels, self.labels[i]

    def load_encoded(self, i: int) -> Tuple[Union[np.ndarray, EncodedJpeg], int]:
        """:meth:`load`, a JPEG that torchvision.io would decode left encoded (``DECODE_ON_DEVICE``)."""
        if self._decoded is not None:
            return self.load(i)
        return read_pixels(self.paths[i], self.mode, self.fits, keep_jpeg=True), self.labels[i]


class SyntheticSource:
    """Deterministic random RGB images (uint8 (IMAGE_SIZE, IMAGE_SIZE, 3)) with balanced labels."""

    def __init__(self, size: int, num_classes: int, image_size: int, split: str):
        if size <= 0 or num_classes <= 0 or image_size <= 0:
            raise ValueError(
                f"synthetic: SYNTHETIC_SIZE ({size}), SYNTHETIC_NUM_CLASSES ({num_classes}) and "
                f"IMAGE_SIZE ({image_size}) must be positive"
            )
        self.image_size, self.num_classes = image_size, num_classes
        self.split_tag = zlib.crc32(split.encode())
        self.labels = [i % num_classes for i in range(size)]
        self.name = "synthetic"

    def __len__(self) -> int:
        return len(self.labels)

    def describe(self, i: int) -> str:
        return f"synthetic[{i}]"

    def load(self, i: int) -> Tuple[np.ndarray, int]:
        label = self.labels[i]
        colour = np.random.default_rng(mix_seed(0xC0105, label)).random(3)
        noise = np.random.default_rng(mix_seed(self.split_tag, i)).random(
            (self.image_size, self.image_size, 3)
        )
        pixels = np.round((0.5 * colour + 0.5 * noise) * 255).astype(np.uint8)
        return pixels, label


def _disk_folder(split_cfg, path: str, cache_dir: str, split_seed: int = 0) -> FileSource:
    if not path:
        raise ConfigError("disk_folder needs a folder in DATA_PATHS")
    root = pick_split_folder(os.path.expanduser(path), split_cfg.SPLIT)
    paths, labels = scan_disk_folder(root, split_cfg.FOLDER_LABELS)
    return FileSource(paths, labels, "disk_folder", fits=draft_fits(split_cfg.TRANSFORMS))


def _disk_filelist(split_cfg, path: str, cache_dir: str, split_seed: int = 0) -> FileSource:
    if not path:
        raise ConfigError("disk_filelist needs a text file in DATA_PATHS")
    paths, labels = read_filelist(os.path.expanduser(path))
    return FileSource(paths, labels, "disk_filelist", fits=draft_fits(split_cfg.TRANSFORMS))


def _synthetic(split_cfg, path: str, cache_dir: str, split_seed: int = 0) -> SyntheticSource:
    return SyntheticSource(
        split_cfg.SYNTHETIC_SIZE, split_cfg.SYNTHETIC_NUM_CLASSES, split_cfg.IMAGE_SIZE, split_cfg.SPLIT
    )


def _demo_digits(split_cfg, path: str, cache_dir: str, split_seed: int = 0) -> FileSource:
    demo_split_size(split_cfg.SPLIT)  # a valid split
    root = ensure_demo_digits_on_every_node(cache_dir)
    paths, labels, _ = scan_image_folder(os.path.join(root, split_cfg.SPLIT))
    # gray digits: made into views on one channel, decoded once (1,437 x 32 x 32 bytes)
    return FileSource(paths, labels, "demo_digits", mode="L", keep_decoded=True)


def _elpv(split_cfg, path: str, cache_dir: str, split_seed: int = 0) -> elpv.ElpvSource:
    folder = os.path.expanduser(path) if path else elpv.package_folder()
    return elpv.ElpvSource(folder, split_cfg.SPLIT, split_seed, split_cfg.DECODE_SIZE)


SOURCES: Dict[str, Callable] = {
    "disk_folder": _disk_folder,
    "disk_filelist": _disk_filelist,
    "synthetic": _synthetic,
    "demo_digits": _demo_digits,
    "elpv": _elpv,
    "webdataset": shards.webdataset_source,
    "hf_dataset": hf_dataset,
}


class SSLDataset(Dataset):
    """Concatenated sources + a view transform; item ``(index, epoch)`` -> one prepared sample.

    A sample is ``{"prepared": the transform's per-image part (pixels and random draws), "label":
    int, "index": int, "skipped": int}``; :meth:`collate` turns a list of them into a batch (the
    views of all its images made at once), :meth:`views` gives one sample's views. The draws come
    from a generator seeded with ``mix_seed(seed, epoch, index)``, so the views depend only on
    (seed, epoch, index): not on the batch, the worker count, the rank or the world size. A plain
    int key means epoch 0.

    Unreadable images (missing, truncated, not an image) raise a CorruptImageError naming the file
    and the ``<key>.SKIP_CORRUPT`` switch (``key``: the split's config section), or with
    ``skip_corrupt`` are logged with their path and replaced by the next readable sample in index
    order; then ``"index"``/``"label"`` are the replacement's and ``"skipped"`` counts the images
    passed over. ``num_skipped`` totals them in *this* process only: with DataLoader workers, sum
    the batches' ``"num_skipped"`` instead.

    ``channels``: the views' (``DATA.CHANNELS``); each image is fitted to them before the transform
    (``vistrain.data.pixels.fit_channels``), a DataError naming the file when it cannot be.

    ``decode_later`` (``DECODE_ON_DEVICE``, with a transform that draws from the image's size alone,
    ``draw``): a JPEG that torchvision.io would decode as it is (no channels to fit) stays encoded,
    ``"prepared"`` holding ``{"jpeg": EncodedJpeg, "draws", "redo": (index, epoch, skipped)}``
    (the draws the decoded image would get); where it cannot be decoded later, :meth:`sample`
    with ``redo`` gives the sample the CPU path gives (SKIP_CORRUPT as ever).
    """

    def __init__(
        self,
        sources: Sequence,
        transform: Callable,
        seed: int = 0,
        skip_corrupt: bool = False,
        limit: int = -1,
        key: str = "DATA.TRAIN",
        channels: int = 3,
        decode_later: bool = False,
    ):
        self.sources = list(sources)
        self.offsets = np.cumsum([0] + [len(s) for s in self.sources]).tolist()
        total = self.offsets[-1]
        self.length = total if limit is None or limit < 0 else min(limit, total)
        if self.length == 0:
            raise DataError(f"{key} is empty (check DATA_SOURCES, DATA_PATHS and DATA_LIMIT)")
        self.transform, self.seed, self.skip_corrupt, self.key = transform, seed, skip_corrupt, key
        self.channels = channels
        self.decode_later = decode_later and hasattr(transform, "draw")
        self.num_skipped = 0
        self._reported = set()

    def __len__(self) -> int:
        return self.length

    @property
    def targets(self) -> List[int]:
        """Labels of all samples in index order (no image is read)."""
        labels = [label for source in self.sources for label in source.labels]
        return labels[: self.length]

    def _locate(self, index: int) -> Tuple[object, int]:
        which = bisect.bisect_right(self.offsets, index) - 1
        return self.sources[which], index - self.offsets[which]

    def describe(self, index: int) -> str:
        """Where sample ``index`` comes from: its file's path, or ``<source>[i]`` for a source
        without files (no image is read)."""
        source, local = self._locate(index)
        describe = getattr(source, "describe", None)
        return describe(local) if describe else f"{getattr(source, 'name', 'source')}[{local}]"

    def image(self, index: int) -> Tuple[np.ndarray, int]:
        """Sample ``index`` as its source decodes it, before any transform: (uint8 (H, W, 3) RGB or
        (H, W) grayscale, label)."""
        source, local = self._locate(index)
        return source.load(local)

    def _load_readable(
        self, index: int, first: int = 0, encoded: bool = False
    ) -> Tuple[Union[np.ndarray, EncodedJpeg], int, int, int]:
        """(pixels, label, index actually used, images skipped before it), the search starting
        ``first`` images after ``index``; ``encoded``: JPEGs left encoded where they can be."""
        for skipped in range(first, min(self.length, MAX_CONSECUTIVE_BAD)):
            current = (index + skipped) % self.length
            source, local = self._locate(current)
            try:
                image, label = self._load(source, local, encoded)
                self.num_skipped += skipped
                return image, label, current, skipped
            except CorruptImageError as err:
                if not self.skip_corrupt:
                    raise CorruptImageError(
                        f"{err}; set {self.key}.SKIP_CORRUPT=True to skip unreadable images"
                    ) from None
                if current not in self._reported:  # one warning per bad file per process
                    self._reported.add(current)
                    logger.warning("skipping unreadable image (SKIP_CORRUPT): %s", err)
        source, local = self._locate(index)
        raise DataError(
            f"{min(self.length, MAX_CONSECUTIVE_BAD)} consecutive unreadable images starting at "
            f"{source.describe(local)}; is the data set broken?"
        )

    def _load(self, source, local: int, encoded: bool) -> Tuple[Union[np.ndarray, EncodedJpeg], int]:
        if not encoded or not hasattr(source, "load_encoded"):
            return source.load(local)
        image, label = source.load_encoded(local)
        have = image.shape[0] if isinstance(image, EncodedJpeg) else self.channels
        if have != self.channels and not (have == 1 and self.channels == 3):  # channels to fit first
            image = image.decode()
        return image, label

    def __getitem__(self, key: Union[int, Tuple[int, int]]) -> dict:
        index, epoch = key if isinstance(key, tuple) else (key, 0)
        return self.sample(index, epoch, encoded=self.decode_later)

    def sample(self, index: int, epoch: int, redo: int = 0, encoded: bool = False) -> dict:
        """The sample ``index`` of ``epoch`` (``self[index, epoch]``), the image searched from
        ``redo`` images after ``index`` (the first an image left encoded that could not be decoded
        later: decoded here, SKIP_CORRUPT as ever); ``encoded``: see ``decode_later``."""
        if not 0 <= index < self.length:
            raise IndexError(f"index {index} out of range for a data set of {self.length}")
        image, label, used, skipped = self._load_readable(index, redo, encoded)
        generator = torch.Generator().manual_seed(mix_seed(self.seed, epoch, index))
        if isinstance(image, EncodedJpeg):
            draws = self.transform.draw(image.shape[1:], generator)
            prepared = {"jpeg": image, "draws": draws, "redo": (index, epoch, skipped)}
        else:
            prepared = self.transform.prepare(self._fitted(image, used), generator)
        return {"prepared": prepared, "label": int(label), "index": used, "skipped": skipped}

    def _fitted(self, image: np.ndarray, index: int) -> np.ndarray:
        try:
            return fit_channels(image, self.channels)
        except DataError as err:
            source, local = self._locate(index)
            raise DataError(f"{source.describe(local)}: {err}") from None

    def collate(self, samples: List[dict]) -> dict:
        """A batch of samples (see :func:`vistrain.data.collate.collate_multicrop`)."""
        return collate_multicrop(samples, self.transform)

    def views(self, key: Union[int, Tuple[int, int]]) -> List[torch.Tensor]:
        """The views of one sample: List[Tensor (C, h, w)], as its batch would hold them (made
        here, on the CPU, also with ``decode_later``)."""
        index, epoch = key if isinstance(key, tuple) else (key, 0)
        return [crops[0] for crops in self.collate([self.sample(index, epoch)])["crops"]]


class IndexSubset(Dataset):
    """The samples ``indices`` of an SSLDataset, in that order; keys ``i`` / ``(i, epoch)`` like SSLDataset's.

    Samples keep the parent's ``"index"`` (and so its augmentation seeds), so counts that
    de-duplicate by index stay exact. ``targets`` are the selected samples' labels.
    """

    def __init__(self, dataset: SSLDataset, indices: Sequence[int]):
        self.dataset, self.indices = dataset, [int(i) for i in indices]
        if not self.indices or not all(0 <= i < len(dataset) for i in self.indices):
            raise ValueError(
                f"IndexSubset needs indices in [0, {len(dataset)}), got {len(self.indices)} of them"
            )

    def __len__(self) -> int:
        return len(self.indices)

    @property
    def targets(self) -> List[int]:
        labels = self.dataset.targets
        return [labels[i] for i in self.indices]

    @property
    def transform(self) -> Callable:
        return self.dataset.transform

    def __getitem__(self, key: Union[int, Tuple[int, int]]) -> dict:
        index, epoch = key if isinstance(key, tuple) else (key, 0)
        return self.dataset[(self.indices[index], epoch)]

    def sample(self, index: int, epoch: int, redo: int = 0, encoded: bool = False) -> dict:
        """The parent's :meth:`SSLDataset.sample` (``index`` the parent's, as ``"redo"`` holds it)."""
        return self.dataset.sample(index, epoch, redo, encoded)

    def collate(self, samples: List[dict]) -> dict:
        return self.dataset.collate(samples)

    def views(self, key: Union[int, Tuple[int, int]]) -> List[torch.Tensor]:
        index, epoch = key if isinstance(key, tuple) else (key, 0)
        return self.dataset.views((self.indices[index], epoch))


def build_dataset(
    split_cfg,
    cache_dir: str = "",
    seed: int = 0,
    key: str = "DATA.TRAIN",
    split_seed: int = 0,
    channels: int = 3,
    mean_std: Optional[Tuple[List[float], List[float]]] = None,
) -> SSLDataset:
    """Dataset of one split from ``DATA.<split>`` (``cache_dir`` is ``DATA.CACHE_DIR``; ``key``
    the split's section, named by errors; ``split_seed`` is ``DATA.SPLIT_SEED``; ``channels``
    ``DATA.CHANNELS``; ``mean_std`` the normalisation computed from the images: ``loader.image_statistics``)."""
    sources = build_sources(split_cfg, cache_dir, split_seed)
    transform = build_transform(split_cfg.TRANSFORMS, channels, mean_std, split_cfg.PIXEL_RANGE)
    return SSLDataset(
        sources, transform, seed, split_cfg.SKIP_CORRUPT, split_cfg.DATA_LIMIT, key, channels,
        decode_later=split_cfg.DECODE_ON_DEVICE,
    )  # fmt: skip


def build_sources(split_cfg, cache_dir: str = "", split_seed: int = 0) -> List:
    """The sources of ``DATA.<split>`` in order (arguments as :func:`build_dataset`'s)."""
    return [SOURCES[name](split_cfg, path, cache_dir, split_seed) for name, path in _named_paths(split_cfg)]


def count_samples(split_cfg) -> int:
    """Samples of ``DATA.<split>`` after DATA_LIMIT, as :func:`build_dataset` would hold them,
    without reading an image or writing the demo cache; DataError when there are none. (An elpv
    side's size does not depend on DATA.SPLIT_SEED.)"""
    total = 0
    for name, path in _named_paths(split_cfg):
        if name == "demo_digits":
            total += demo_split_size(split_cfg.SPLIT)
        else:
            total += len(SOURCES[name](split_cfg, path, ""))
    limit = split_cfg.DATA_LIMIT
    samples = total if limit < 0 else min(limit, total)
    if samples == 0:
        raise DataError("holds no samples (check DATA_SOURCES, DATA_PATHS and DATA_LIMIT)")
    return samples


def _named_paths(split_cfg) -> List[Tuple[str, str]]:
    """(source name, its DATA_PATHS entry) of each source; sources that need no path may omit it."""
    names, paths = list(split_cfg.DATA_SOURCES), list(split_cfg.DATA_PATHS)
    if not names:
        raise ConfigError("DATA_SOURCES is empty; valid sources: " + ", ".join(sorted(SOURCES)))
    if len(paths) > len(names):
        raise ConfigError(f"DATA_PATHS has {len(paths)} entries for {len(names)} DATA_SOURCES")
    unknown = [name for name in names if name not in SOURCES]
    if unknown:
        raise ConfigError(f"unknown data source {unknown[0]!r}; valid sources: {sorted(SOURCES)}")
    return list(zip(names, paths + [""] * (len(names) - len(paths))))
