"""A Hugging Face ``datasets`` data set on disk as a source (``DATA_SOURCES: [hf_dataset]``;
``pip install "vistrain[datasets]"``), read without the network (``HF_DATASETS_OFFLINE=1``).

``DATA_PATHS`` names one of

* a folder written by ``Dataset.save_to_disk`` or ``DatasetDict.save_to_disk`` (its arrow files
  are memory-mapped: nothing is copied);
* a ``.parquet`` file, or a folder holding ``.parquet`` files (any depth; split names in the
  file names, as the Hub lays them out, make splits): ``load_dataset("parquet")``;
* any other folder: an image folder, ``load_dataset("imagefolder")`` (class subfolders give its
  ``label`` column, ``train/`` and ``test/`` folders its splits).

Parquet files and image folders are converted once to arrow files in the ``datasets`` cache
(``HF_DATASETS_CACHE``, by default ~/.cache/huggingface/datasets), which the ranks and later runs
reuse. ``HF_SPLIT`` picks a split ("": the only one there is); ``HF_IMAGE_COLUMN`` names the images:
an ``Image`` column (decoded here from its bytes or file as the folder sources decode files,
:func:`vistrain.data.pixels.decode_pixels`: 8-bit images as RGB, deeper ones and arrays as they
are) or a column of arrays (H, W) or (H, W, C) (``Array2D`` / ``Array3D``, or nested lists);
``HF_LABEL_COLUMN`` the integer labels (a ``ClassLabel``), "" for none (label -1). Samples are
read by index, so the sampler, a resume and ``SKIP_CORRUPT`` work as for folders.
"""

import glob
import os
from typing import List, Tuple

import numpy as np

from vistrain.config.errors import ConfigError, DataError
from vistrain.data.pixels import checked_array, decode_pixels, read_pixels

SAVED_MARKERS = ("dataset_dict.json", "state.json")  # what save_to_disk writes at the top


def hf_dataset(split_cfg, path: str, cache_dir: str = "", split_seed: int = 0) -> "HFSource":
    """The ``hf_dataset`` source of ``DATA.<split>`` (``cache_dir``, ``split_seed``: unused)."""
    if not path:
        raise ConfigError(
            "hf_dataset needs a data set on disk in DATA_PATHS: a save_to_disk folder, an image folder or parquet files"
        )
    path = os.path.expanduser(path)
    data = _pick_split(_load(path), split_cfg.HF_SPLIT, path)
    return HFSource(data, split_cfg.HF_IMAGE_COLUMN, split_cfg.HF_LABEL_COLUMN, path)


def _datasets():
    """The ``datasets`` package, offline (the variable is read when it is first imported)."""
    os.environ["HF_DATASETS_OFFLINE"] = "1"
    try:
        import datasets
    except ImportError:
        raise ConfigError(
            'DATA_SOURCES hf_dataset needs the datasets package: pip install "vistrain[datasets]"'
        ) from None
    datasets.config.HF_HUB_OFFLINE = True  # imported before with the network on: off from now
    return datasets


def _load(path: str):
    """The Dataset or DatasetDict at ``path`` (see the module docstring); DataError (one line)
    when ``datasets`` cannot read it."""
    datasets = _datasets()
    if not os.path.isdir(path) and not (os.path.isfile(path) and path.endswith(".parquet")):
        raise DataError(
            f"hf_dataset: {path} is neither a folder (save_to_disk, image folder, parquet files) nor a .parquet file"
        )
    try:
        return _read(datasets, path)
    except (FileNotFoundError, ValueError) as err:  # datasets' DataFilesNotFoundError, EmptyDatasetError...
        raise DataError(f"hf_dataset: cannot read {path}: {str(err).splitlines()[0]}") from None


def _read(datasets, path: str):
    if os.path.isdir(path):
        if any(os.path.isfile(os.path.join(path, marker)) for marker in SAVED_MARKERS):
            return datasets.load_from_disk(path)
        if glob.glob(os.path.join(glob.escape(path), "**", "*.parquet"), recursive=True):
            return datasets.load_dataset("parquet", data_dir=path)
        return datasets.load_dataset("imagefolder", data_dir=path)
    return datasets.load_dataset("parquet", data_files=path)


def _pick_split(data, split: str, path: str):
    """The Dataset of ``split`` (HF_SPLIT) in ``data``; ConfigError (one line) naming the splits."""
    splits = list(data.keys()) if hasattr(data, "keys") else []
    if not splits:  # a Dataset: one split
        if split:
            raise ConfigError(f"hf_dataset: {path} holds one data set without splits; set HF_SPLIT to ''")
        return data
    if not split and len(splits) == 1:
        return data[splits[0]]
    if split not in splits:
        what = f"HF_SPLIT {split!r} is not one of them" if split else "set HF_SPLIT to one of them"
        raise ConfigError(f"hf_dataset: {path} holds the splits {', '.join(splits)}; {what}")
    return data[split]


class HFSource:
    """One split of a ``datasets`` data set: ``load(i) -> (pixels, label)``, pixels (H, W) or
    (H, W, C) as :func:`vistrain.data.pixels.decode_pixels` gives them, label an int (-1: none)."""

    name = "hf_dataset"

    def __init__(self, data, image_column: str, label_column: str, path: str):
        self.path = path
        for column, key in ((image_column, "HF_IMAGE_COLUMN"), (label_column, "HF_LABEL_COLUMN")):
            if column and column not in data.column_names:
                hint = "; '' for unlabelled data" if key == "HF_LABEL_COLUMN" else ""
                raise ConfigError(
                    f"hf_dataset: {path} has no column {column!r} ({key}); its columns: "
                    f"{', '.join(data.column_names)}{hint}"
                )
        self.labels = self._labels(data, label_column)
        self.encoded = type(data.features[image_column]).__name__ == "Image"
        if self.encoded:  # the bytes (or the file), decoded by vistrain as any image file
            data = data.cast_column(image_column, type(data.features[image_column])(decode=False))
        else:
            data = data.with_format("numpy", columns=[image_column])
        self.data, self.column = data, image_column

    def _labels(self, data, column: str) -> List[int]:
        if not column:
            return [-1] * len(data)
        values = data.with_format("arrow")[column]
        kind = str(values.type)
        if not kind.startswith(("int", "uint")):
            raise ConfigError(
                f"hf_dataset: {self.path} column {column!r} (HF_LABEL_COLUMN) holds {kind}, not integer labels"
            )
        return [-1 if v is None else int(v) for v in values.to_pylist()]

    def __len__(self) -> int:
        return len(self.labels)

    def describe(self, i: int) -> str:
        return f"{self.path}[{i}]"

    def load(self, i: int) -> Tuple[np.ndarray, int]:
        value = self.data[i][self.column]
        if not self.encoded:
            return checked_array(np.asarray(value), self.describe(i)), self.labels[i]
        if value.get("bytes"):
            return decode_pixels(value["bytes"], self.describe(i)), self.labels[i]
        if value.get("path"):
            return read_pixels(value["path"]), self.labels[i]
        raise DataError(f"hf_dataset: {self.describe(i)} holds no image (neither bytes nor a path)")
