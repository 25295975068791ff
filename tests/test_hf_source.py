"""Hugging Face data sets on disk as a source (vistrain/data/hf_source.py): a tiny data set made
here and saved with save_to_disk, read back labelled and unlabelled, by split, as parquet, with
array images of four bands, and the one-line errors for a missing column or an unnamed split."""

import sys

import datasets
import numpy as np
import pytest
import torch
from PIL import Image

from vistrain.config import ConfigError
from vistrain.data.datasets import build_dataset, count_samples
from vistrain.methods import load_config

RNG = np.random.default_rng(0)
PIXELS = [RNG.integers(0, 256, (10, 12, 3), dtype=np.uint8) for _ in range(6)]
FEATURES = datasets.Features({"image": datasets.Image(), "label": datasets.ClassLabel(names=["a", "b", "c"])})


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    """Parquet files are converted to arrow in the datasets cache: this test's, not the user's."""
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "hf_cache")


def _photos() -> datasets.Dataset:
    images = [Image.fromarray(p) for p in PIXELS]
    return datasets.Dataset.from_dict({"image": images, "label": [0, 1, 2, 0, 1, 2]}, features=FEATURES)


def _split_cfg(path, *overrides, split="TRAIN"):
    cfg = load_config(
        [
            "config=test/simclr_tiny",
            f"config.DATA.{split}.DATA_SOURCES=[hf_dataset]",
            f"config.DATA.{split}.DATA_PATHS=[{path}]",
            *overrides,
        ]
    )
    return cfg.DATA[split]


def _pixels(split_cfg, channels=3):
    data = build_dataset(split_cfg, channels=channels)
    return data, [data.sources[0].load(i)[0] for i in range(len(data))]


def test_a_saved_data_set_is_read_labelled_and_unlabelled(tmp_path):
    _photos().save_to_disk(str(tmp_path / "saved"))
    data, pixels = _pixels(_split_cfg(tmp_path / "saved"))
    assert data.targets == [0, 1, 2, 0, 1, 2] and count_samples(_split_cfg(tmp_path / "saved")) == 6
    for got, want in zip(pixels, PIXELS):
        np.testing.assert_array_equal(got, want)
    crops = data.collate([data[(i, 1)] for i in range(4)])["crops"]
    assert [tuple(c.shape) for c in crops] == [(4, 3, 16, 16)] * 2
    unlabelled = build_dataset(_split_cfg(tmp_path / "saved", 'config.DATA.TRAIN.HF_LABEL_COLUMN=""'))
    assert unlabelled.targets == [-1] * 6
    assert torch.equal(unlabelled.views((2, 1))[0], data.views((2, 1))[0])  # the same views


def test_splits_parquet_and_the_one_line_errors(tmp_path):
    datasets.DatasetDict({"train": _photos(), "test": _photos().select([4, 5])}).save_to_disk(
        str(tmp_path / "dict")
    )
    test = build_dataset(_split_cfg(tmp_path / "dict", "config.DATA.TEST.HF_SPLIT=test", split="TEST"))
    assert test.targets == [1, 2]
    with pytest.raises(ConfigError, match="holds the splits train, test; set HF_SPLIT to one of them"):
        build_dataset(_split_cfg(tmp_path / "dict"))
    _photos().to_parquet(str(tmp_path / "photos.parquet"))
    data, pixels = _pixels(_split_cfg(tmp_path / "photos.parquet"))
    assert data.targets == [0, 1, 2, 0, 1, 2]
    np.testing.assert_array_equal(pixels[5], PIXELS[5])
    with pytest.raises(
        ConfigError, match=r"has no column 'img' \(HF_IMAGE_COLUMN\); its columns: image, label$"
    ):
        build_dataset(_split_cfg(tmp_path / "photos.parquet", "config.DATA.TRAIN.HF_IMAGE_COLUMN=img"))
    with pytest.raises(
        ConfigError, match="no column 'labels' .*; its columns: image, label; '' for unlabelled data"
    ):
        build_dataset(_split_cfg(tmp_path / "photos.parquet", "config.DATA.TRAIN.HF_LABEL_COLUMN=labels"))


def test_array_images_of_four_bands(tmp_path):
    bands = [RNG.random((8, 8, 4), dtype=np.float32) for _ in range(3)]
    features = datasets.Features(
        {"bands": datasets.Array3D((8, 8, 4), "float32"), "label": datasets.Value("int64")}
    )
    datasets.Dataset.from_dict({"bands": bands, "label": [0, 1, 0]}, features=features).save_to_disk(
        str(tmp_path / "bands")
    )
    split_cfg = _split_cfg(
        tmp_path / "bands",
        "config.DATA.TRAIN.HF_IMAGE_COLUMN=bands",
        "config.DATA.TRAIN.TRANSFORMS.MEAN=[0.5]",
        "config.DATA.TRAIN.TRANSFORMS.STD=[0.25]",
    )
    data, pixels = _pixels(split_cfg, channels=4)
    np.testing.assert_array_equal(pixels[1], bands[1])
    assert data.views(0)[0].shape == (4, 16, 16)


def test_without_datasets_the_line_names_the_extra(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "datasets", None)  # import datasets now fails
    with pytest.raises(
        ConfigError,
        match=r'^DATA_SOURCES hf_dataset needs the datasets package: pip install "vistrain\[datasets\]"$',
    ):
        build_dataset(_split_cfg(tmp_path))
