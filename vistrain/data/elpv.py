"""ELPV: electroluminescence images of solar cells (Buerhop-Lutz et al. 2018; Deitsch et al., Solar
Energy 2019), read from the installed ``elpv-dataset`` package (``pip install -e ".[elpv]"``).

2,624 cells of 300 x 300 8-bit grayscale from 44 modules; ``labels.csv`` gives each image's defect
probability (0, 1/3, 2/3, 1: four classes 0..3) and the cell type (mono, poly). The images are
CC BY-NC-SA 4.0: they are read where the package put them, never copied into this repository.

There is no official split. :func:`stratified_split` draws the paper's 75/25 proportion (1,968 train,
656 test), stratified by (class, type), from ``DATA.SPLIT_SEED``. ``labels.csv`` has no module ids,
so a random split puts cells of one module on both sides (the paper's did too, as far as is known).
``SPLIT: train`` reads the 75% side, ``SPLIT: val`` the 25% test side. For choosing a recipe
without the test side, ``train_select`` is a quarter of the train side drawn the same way (492
cells) and ``train_fit`` the rest (1,476): pretrain and fit the probe on ``train_fit``, score it on
``train_select``, cells the pretraining did not see (a cross-validation on pretrained-on cells
rewards recipes that fit those cells better without the unseen ones following).

Decoding a 300 px PNG costs more than an augmented view of it, so every image is decoded once per
process, resized to ``DECODE_SIZE`` (0: kept at 300) and kept in memory as 8-bit grayscale
(1,968 train images at 128 px: 32 MB).
"""

import importlib.util
import os
from typing import Dict, List, Sequence, Tuple

import numpy as np
from PIL import Image

from vistrain.config.errors import ConfigError, DataError
from vistrain.data.folders import read_image

NUM_CLASSES = 4  # defect probabilities 0, 1/3, 2/3, 1
DEFECTIVE_FROM = 2  # classes 2 and 3 (p >= 0.5) are defective in the two-class protocol
TEST_FRACTION = 0.25  # the paper's 1,968 / 656
SPLITS = ("train", "val", "train_fit", "train_select")


def package_folder() -> str:
    """The data folder of the installed ``elpv_dataset`` package (``labels.csv``, ``images/``)."""
    spec = importlib.util.find_spec("elpv_dataset")  # finds the files without importing the package
    if spec is None or not spec.submodule_search_locations:
        raise ConfigError(
            "elpv: the elpv-dataset package is not installed; pip install -e '.[elpv]' (or pip install "
            "elpv-dataset), or set DATA_PATHS to a folder holding labels.csv and images/"
        )
    return os.path.join(list(spec.submodule_search_locations)[0], "data")


def read_labels(folder: str) -> Tuple[List[str], np.ndarray, np.ndarray]:
    """(image paths, class (N,) int64 in 0..3, type (N,) '<U4' mono/poly) from ``folder/labels.csv``.

    Each line is ``images/cellNNNN.png <probability> <type>``, whitespace separated.
    """
    csv = os.path.join(folder, "labels.csv")
    if not os.path.isfile(csv):
        raise DataError(f"elpv: {csv} not found (DATA_PATHS must hold labels.csv and images/)")
    paths, classes, types = [], [], []
    with open(csv) as handle:
        for lineno, line in enumerate(handle, 1):
            parts = line.split()
            if not parts:
                continue
            try:
                path, prob, kind = parts
                label = int(round(float(prob) * (NUM_CLASSES - 1)))
            except ValueError:
                raise DataError(
                    f"{csv}:{lineno}: expected '<image> <probability> <type>', got {line.strip()!r}"
                ) from None
            if not 0 <= label < NUM_CLASSES:
                raise DataError(f"{csv}:{lineno}: probability {prob} is outside [0, 1]")
            paths.append(os.path.join(folder, path))
            classes.append(label)
            types.append(kind)
    if not paths:
        raise DataError(f"elpv: {csv} lists no images")
    return paths, np.asarray(classes, dtype=np.int64), np.asarray(types)


def stratified_split(
    strata: Sequence, seed: int, test_fraction: float = TEST_FRACTION
) -> Tuple[List[int], List[int]]:
    """(train, test) sample indices, sorted, disjoint, covering everything: a pure function of
    ``strata`` (one hashable key per sample, e.g. (class, type)) and ``seed``.

    The test side takes ``round(test_fraction * N)`` samples in all (656 of ELPV's 2,624), shared
    among the strata in proportion to their sizes by largest remainders (each stratum gets the
    floor of its quota, the leftover samples go to the largest fractional parts, ties to the first
    stratum in sorted order); the samples of each stratum are drawn by a permutation seeded with
    ``seed``.
    """
    keys = [tuple(k) if isinstance(k, (list, tuple)) else (k,) for k in strata]
    groups: Dict[tuple, List[int]] = {}
    for index, key in enumerate(keys):
        groups.setdefault(key, []).append(index)
    order = sorted(groups)
    quotas = np.array([test_fraction * len(groups[k]) for k in order])
    takes = np.floor(quotas).astype(int)
    leftover = int(round(test_fraction * len(keys))) - int(takes.sum())
    by_remainder = sorted(range(len(order)), key=lambda i: (-(quotas[i] - takes[i]), i))
    for i in by_remainder[:leftover]:
        takes[i] += 1
    rng = np.random.RandomState(seed)
    test: List[int] = []
    for key, take in zip(order, takes):
        test += rng.permutation(groups[key])[:take].tolist()
    test_set = set(test)
    return [i for i in range(len(keys)) if i not in test_set], sorted(test)


def check_split(split: str) -> None:
    if split not in SPLITS:
        raise ConfigError(
            f"elpv: SPLIT {split!r} is not one of train (75%), val (the 25% test side), train_fit and "
            "train_select (75 / 25 of the train side, for choosing a recipe)"
        )


def split_side(strata: Sequence, split: str, seed: int) -> List[int]:
    """Sorted sample indices of ``split`` (one of :data:`SPLITS`): ``train`` / ``val`` are the two
    sides of ``stratified_split(strata, seed)``; ``train_fit`` / ``train_select`` the two sides of
    the same draw applied to the train side's strata (75 / 25 of it), so both lie inside ``train``.
    """
    check_split(split)
    train, test = stratified_split(strata, seed)
    if split in ("train", "val"):
        return train if split == "train" else test
    fit, select = stratified_split([strata[i] for i in train], seed)
    return [train[i] for i in (fit if split == "train_fit" else select)]


class ElpvSource:
    """One side of an ELPV split: ``load(i) -> (grayscale uint8 (DECODE_SIZE, DECODE_SIZE), class 0..3)``.

    ``labels`` (4 classes) and ``types`` follow the split's order; decoded images are cached per
    process as 8-bit arrays. The views are made on the one channel (a third of the work of RGB;
    hue and saturation jitter are no-ops on it) and turned into three equal channels last.
    """

    name = "elpv"
    class_names = ("p=0", "p=1/3", "p=2/3", "p=1")  # defect probability of each class

    def __init__(self, folder: str, split: str, split_seed: int, decode_size: int = 0):
        check_split(split)  # before reading anything
        paths, classes, types = read_labels(folder)
        side = split_side(list(zip(classes.tolist(), types.tolist())), split, split_seed)
        self.paths = [paths[i] for i in side]
        self.labels = classes[side].tolist()
        self.types = types[side].tolist()
        self.decode_size = int(decode_size)
        self._decoded: Dict[int, np.ndarray] = {}

    def __len__(self) -> int:
        return len(self.paths)

    def describe(self, i: int) -> str:
        return self.paths[i]

    def load(self, i: int) -> Tuple[np.ndarray, int]:
        pixels = self._decoded.get(i)
        if pixels is None:
            image = read_image(self.paths[i]).convert("L")
            if self.decode_size and image.size != (self.decode_size, self.decode_size):
                image = image.resize((self.decode_size, self.decode_size), Image.BILINEAR, reducing_gap=None)
            pixels = self._decoded[i] = np.array(image)
        return pixels, self.labels[i]
