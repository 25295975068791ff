"""Tar shards as a data source (``DATA_SOURCES: [webdataset]``) and the epoch rule that reads them.

Shards are uncompressed tar files in webdataset's layout: the members of a sample are consecutive
and share a key, the member name up to the first dot of its base name (``cat/0042.jpg`` and
``cat/0042.cls``); the image is the first member whose extension is an image's (``jpg``, ``png``;
not ``seg.png``), the label the integer text of its ``cls`` member (-1 without one). ``DATA_PATHS`` holds a brace pattern such as
``/data/shards/train-{000000..000099}.tar`` (expanded by ``braceexpand``, as webdataset does); sample
``i`` is the i-th sample of the shards concatenated in the pattern's order.

Each shard has an index beside it, ``<shard>.index.json``: its samples' keys, labels, and the byte
offset, size and extension of each image member (``tools/make_shards.py`` writes it;
``tools/make_shards.py --index-only PATTERN`` indexes shards written by other tools; a shard
without one is refused in one line naming that command). From the indexes every process knows the
sample count and plans the epoch without opening a shard, and reads an image with one ``pread`` at
its offset, so evaluation jobs and the view grid read shards by index like a folder.

The epoch rule (every ``DATA_SOURCES`` entry ``webdataset``; N samples, W ranks, per-rank batch B,
window K = ``SHUFFLE_WINDOW``); every draw comes from ``(seed, epoch)`` or ``(seed, epoch, rank)``:

1. The stream: the shards in a random order, their samples concatenated in it, rotated to start
   at a random position.
2. Rank r takes the contiguous part ``[r P, (r + 1) P)`` of the stream: with ``DROP_LAST``
   ``P = floor(N / (W B)) B``, so the last ``N - W P <= W B - 1`` samples of the stream are not seen
   this epoch (the shuffled order and the rotation move them every epoch); without it ``P = ceil(N
   / W)`` and the stream repeats from its start to fill the last part (a few samples twice). A rank
   reads about 1/W of the shards, each in one stretch.
3. Each rank shuffles its part within consecutive windows of K samples (a shuffle buffer of K
   that needs no filling) and cuts it into batches of B; DataLoader workers take the batches in
   turn, so the order does not depend on the worker count.

Without ``SHUFFLE`` the shards keep the pattern's order, with no rotation and no windows. So every
rank runs the same number of steps (floor(N / (W B)) with ``DROP_LAST``), each sample is seen at most
once per epoch, the views stay a function of ``(seed, epoch, index)``, and a resume at iteration k
skips the rank's first k B samples of the same plan: the samples the uninterrupted run would have
seen, for the same world size and batch (with another world size the rest of that epoch follows the
new ranks' plan). Mixed with other sources, the samples follow the folders' global shuffle
(``vistrain/data/sampler.py``). An unreadable image is a CorruptImageError naming shard and key, which
``SKIP_CORRUPT`` turns into a skip as for folders (``SSLDataset``).
"""

import collections
import json
import os
import tarfile
from typing import List, Optional, Sequence, Tuple

import numpy as np
import torch

from vistrain.config.errors import ConfigError, DataError
from vistrain.data.folders import UNLABELLED, CorruptImageError, Fits, draft_fits, is_image
from vistrain.data.pixels import decode_pixels
from vistrain.data.sampler import DistributedSampler, mix_seed, samples_per_rank

INDEX_SUFFIX = ".index.json"
INDEX_FORMAT = "vistrain shard index 1"
MAX_OPEN_SHARDS = 8  # open files per process: a rank's window spans one or two shards


def require_webdataset():
    """The ``webdataset`` module (with ``braceexpand``, which it depends on), or a one-line ConfigError."""
    try:
        import braceexpand  # noqa: F401
        import webdataset
    except ImportError:
        raise ConfigError(
            'the webdataset data source needs the webdataset package: pip install "vistrain[webdataset]"'
        ) from None
    return webdataset


def expand_pattern(pattern: str) -> List[str]:
    """The shard paths of a brace pattern, in its order (``~`` expanded); DataError when it names a folder."""
    require_webdataset()
    from braceexpand import braceexpand

    pattern = os.path.expanduser(pattern)
    if os.path.isdir(pattern):
        raise DataError(
            f"webdataset: DATA_PATHS entry {pattern} is a folder; give a brace pattern of its shards, "
            "e.g. /data/shards/train-{000000..000099}.tar"
        )
    return list(braceexpand(pattern))


def index_path(shard: str) -> str:
    return shard + INDEX_SUFFIX


# ------------------------------------------------------------------------------------ the index
def index_shard(shard: str) -> dict:
    """Scan ``shard`` (headers only, and each ``cls`` member) into its index dict: ``keys``,
    ``label`` (int, -1 none), image member ``ext``, byte ``offset`` and ``size``, ``shard_bytes``
    and ``skipped`` (keys without an image member). Members are grouped by key as webdataset does."""
    from webdataset.tariterators import base_plus_ext

    samples: collections.OrderedDict[str, dict] = collections.OrderedDict()
    try:
        with tarfile.open(shard, "r:") as tar:  # "r:": offsets must be positions in the file
            for member in tar:
                key, ext = base_plus_ext(member.name) if member.isfile() else (None, None)
                if key is None:
                    continue
                sample = samples.setdefault(key, {"label": UNLABELLED})
                ext = ext.lower()
                if ext == "cls":
                    sample["label"] = _read_label(tar, member, shard, key)
                elif "image" not in sample and "." not in ext and is_image("." + ext):  # not seg.png
                    sample["image"] = (ext, member.offset_data, member.size)
    except (tarfile.ReadError, EOFError) as err:
        raise DataError(
            f"{shard} is not an uncompressed tar file ({err}); shards are read by offset"
        ) from None
    images = [(key, s) for key, s in samples.items() if "image" in s]
    return {
        "format": INDEX_FORMAT,
        "shard_bytes": os.path.getsize(shard),
        "keys": [key for key, _ in images],
        "label": [s["label"] for _, s in images],
        "ext": [s["image"][0] for _, s in images],
        "offset": [s["image"][1] for _, s in images],
        "size": [s["image"][2] for _, s in images],
        "skipped": len(samples) - len(images),
    }


def _read_label(tar: tarfile.TarFile, member: tarfile.TarInfo, shard: str, key: str) -> int:
    text = tar.extractfile(member).read().strip()
    try:
        return int(text)
    except ValueError:
        raise DataError(f"{shard}: the cls member of {key} is not an integer label: {text[:20]!r}") from None


def write_index(shard: str) -> dict:
    """Index ``shard`` and write ``<shard>.index.json`` (atomically); returns the index."""
    index = index_shard(shard)
    temporary = index_path(shard) + ".tmp"
    with open(temporary, "w") as handle:
        json.dump(index, handle, separators=(",", ":"))
    os.replace(temporary, index_path(shard))
    return index


def read_index(shard: str, pattern: str) -> dict:
    """The index of ``shard``; DataError (one line naming the fix) when the shard or its index is
    missing, or the index was written for another version of the shard."""
    if not os.path.isfile(shard):
        raise DataError(f"webdataset: shard not found: {shard} (DATA_PATHS pattern {pattern})")
    fix = f"python tools/make_shards.py --index-only '{pattern}'"
    try:
        with open(index_path(shard)) as handle:
            index = json.load(handle)
    except FileNotFoundError:
        raise DataError(
            f"webdataset: {shard} has no index {index_path(shard)}; write it with: {fix}"
        ) from None
    except ValueError as err:
        raise DataError(
            f"webdataset: {index_path(shard)} is not a shard index ({err}); rewrite it: {fix}"
        ) from None
    if index.get("format") != INDEX_FORMAT:
        raise DataError(f"webdataset: {index_path(shard)} is not a '{INDEX_FORMAT}'; rewrite it: {fix}")
    if index["shard_bytes"] != os.path.getsize(shard):
        raise DataError(
            f"webdataset: {shard} is {os.path.getsize(shard):,} bytes, its index was written for "
            f"{index['shard_bytes']:,} (the shard changed); rewrite the index: {fix}"
        )
    return index


# ------------------------------------------------------------------------------------ the source
class ShardSource:
    """The samples of tar shards: ``load(i) -> (pixels, label)``, pixels a uint8 array (H, W, 3) RGB
    (``mode`` "RGB") or (H, W) grayscale ("L"), the image member's bytes decoded as a file of a
    folder is (``vistrain.data.pixels.decode_pixels``: deeper images and arrays as they are; ``fits``:
    the views' bound for decoding JPEGs at reduced size).

    Per sample it keeps the image's byte offset and size (int64 arrays) and the label (a list);
    keys are read back from a shard's index only to name a bad sample."""

    def __init__(
        self, pattern: str, name: str = "webdataset", mode: str = "RGB", fits: Optional[Fits] = None
    ):
        self.pattern, self.name, self.mode, self.fits = pattern, name, mode, fits
        self.shards = expand_pattern(pattern)
        indexes = [read_index(shard, pattern) for shard in self.shards]
        self.shard_sizes = [len(index["keys"]) for index in indexes]
        self.starts = np.cumsum([0] + self.shard_sizes)
        self.offsets = np.array([o for index in indexes for o in index["offset"]], dtype=np.int64)
        self.sizes = np.array([s for index in indexes for s in index["size"]], dtype=np.int64)
        self.labels = [label for index in indexes for label in index["label"]]
        self._files: collections.OrderedDict[int, int] = collections.OrderedDict()  # shard -> fd

    def __len__(self) -> int:
        return len(self.labels)

    def __getstate__(self) -> dict:  # a spawned worker opens its own files
        return {**self.__dict__, "_files": collections.OrderedDict()}

    def locate(self, i: int) -> Tuple[int, int]:
        """(shard number, position of sample ``i`` in that shard)."""
        shard = int(np.searchsorted(self.starts, i, side="right")) - 1
        return shard, i - int(self.starts[shard])

    def describe(self, i: int) -> str:
        shard, local = self.locate(i)
        with open(index_path(self.shards[shard])) as handle:
            index = json.load(handle)
        return f"{index['keys'][local]}.{index['ext'][local]} in shard {self.shards[shard]}"

    def read_bytes(self, i: int) -> bytes:
        """The image member of sample ``i`` as stored; CorruptImageError when the shard is gone or short."""
        shard, _ = self.locate(i)
        size = int(self.sizes[i])
        try:
            data = os.pread(self._file(shard), size, int(self.offsets[i]))
        except OSError as err:
            raise CorruptImageError(f"cannot read {self.describe(i)}: {err}") from None
        if len(data) != size:
            raise CorruptImageError(f"cannot read {self.describe(i)}: the shard ends inside it (truncated?)")
        return data

    def load(self, i: int) -> Tuple[np.ndarray, int]:
        # as a file of a folder is decoded (16-bit, multi-band TIFF and .npy members too)
        pixels = decode_pixels(self.read_bytes(i), lambda: self.describe(i), self.mode, self.fits)
        return pixels, self.labels[i]

    def _file(self, shard: int) -> int:
        """An open descriptor of ``shard`` (the least recently used of MAX_OPEN_SHARDS is closed)."""
        if shard in self._files:
            self._files.move_to_end(shard)
            return self._files[shard]
        if len(self._files) >= MAX_OPEN_SHARDS:
            os.close(self._files.popitem(last=False)[1])
        self._files[shard] = os.open(self.shards[shard], os.O_RDONLY)
        return self._files[shard]


def webdataset_source(split_cfg, path: str, cache_dir: str = "", split_seed: int = 0) -> ShardSource:
    """The ``webdataset`` entry of ``vistrain.data.datasets.SOURCES``."""
    if not path:
        raise ConfigError(
            "webdataset needs a brace pattern of tar shards in DATA_PATHS, e.g. /data/shards/train-{000000..000099}.tar"
        )
    return ShardSource(path, fits=draft_fits(split_cfg.TRANSFORMS))


def shard_sizes(dataset) -> Optional[List[int]]:
    """Samples per shard of ``dataset`` (an SSLDataset) in index order, cut at its length
    (DATA_LIMIT); None unless every source is tar shards."""
    sources = getattr(dataset, "sources", None)
    if not sources or not all(isinstance(source, ShardSource) for source in sources):
        return None
    sizes, left = [], len(dataset)
    for size in (size for source in sources for size in source.shard_sizes):
        sizes.append(min(size, left))
        left -= sizes[-1]
    return sizes


# ------------------------------------------------------------------------------------ the epoch rule
def epoch_stream(sizes: Sequence[int], seed: int, epoch: int, shuffle: bool) -> torch.Tensor:
    """Step 1 of the rule: LongTensor (N,) of sample indices, the shards in a random order
    (``randperm`` seeded with ``mix_seed(seed, epoch)``), concatenated, rolled by a random offset."""
    starts = np.cumsum([0] + list(sizes))
    if not shuffle:
        return torch.arange(int(starts[-1]), dtype=torch.long)
    generator = torch.Generator().manual_seed(mix_seed(seed, epoch))
    order = torch.randperm(len(sizes), generator=generator).tolist()
    stream = torch.cat([torch.arange(int(starts[s]), int(starts[s + 1]), dtype=torch.long) for s in order])
    shift = int(torch.randint(len(stream), (1,), generator=generator))
    return torch.roll(stream, -shift)


def rank_shard_indices(
    sizes: Sequence[int],
    world_size: int,
    rank: int,
    batch_size: int,
    seed: int,
    epoch: int,
    shuffle: bool,
    drop_last: bool,
    window: int,
) -> List[int]:
    """Steps 2 and 3 of the rule: rank ``rank``'s sample indices of ``epoch`` in iteration order.

    Its part of the stream, ``stream[(r P + q) mod N]`` for q in [0, P), P = ``samples_per_rank``;
    when shuffling, sorted by ``q // window + u_q`` with ``u_q ~ U[0, 1)`` drawn from
    ``mix_seed(seed, epoch, rank)``: a random order within each window of ``window`` positions."""
    total = int(sum(sizes))
    per_rank = samples_per_rank(total, world_size, batch_size, drop_last)
    stream = epoch_stream(sizes, seed, epoch, shuffle)
    mine = stream[torch.arange(rank * per_rank, (rank + 1) * per_rank) % total]
    if shuffle:
        generator = torch.Generator().manual_seed(mix_seed(seed, epoch, rank))
        keys = torch.arange(per_rank, dtype=torch.float64).div_(window).floor_()
        keys += torch.rand(per_rank, dtype=torch.float64, generator=generator)
        mine = mine[torch.argsort(keys)]
    return mine.tolist()


class ShardSampler(DistributedSampler):
    """A DistributedSampler (``(index, epoch)`` keys, ``set_epoch(epoch, start_iteration)``, equal
    batches on every rank) whose order is the shards' epoch rule (module docstring).

    Args:
        sizes: samples per shard, in index order (:func:`shard_sizes`).
        window: SHUFFLE_WINDOW, samples shuffled together within a rank's part.
        The rest as :class:`vistrain.data.sampler.DistributedSampler`.
    """

    def __init__(self, sizes: Sequence[int], batch_size: int, window: int, **kwargs):
        super().__init__(int(sum(sizes)), batch_size, **kwargs)
        if window < 1:
            raise ConfigError(f"SHUFFLE_WINDOW must be at least 1, got {window}")
        self.sizes, self.window = list(sizes), window

    def indices(self) -> List[int]:
        mine = rank_shard_indices(
            self.sizes,
            self.world_size,
            self.rank,
            self.batch_size,
            self.seed,
            self.epoch,
            self.shuffle,
            self.drop_last,
            self.window,
        )
        return mine[self.start_iteration * self.batch_size :]
