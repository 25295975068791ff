"""Data pipeline: sampler rank arithmetic, transforms + collate, sources, bad data, demo set, loader."""

import logging
import os
import re
import subprocess
import sys

import numpy as np
import pytest
import torch
from PIL import Image

import vistrain.data.demo_digits as demo
from vistrain.config import DataError
from vistrain.data import (
    CorruptImageError,
    DistributedSampler,
    build_dataset,
    build_loader,
    ensure_demo_digits,
    rank_indices,
    set_epoch,
)
from vistrain.data.datasets import count_samples
from vistrain.data.transforms import MultiCropTransform
from vistrain.distributed.testing import run_on_ranks
from vistrain.methods import get_defaults

CPU = torch.device("cpu")


def _data_cfg(**split_overrides):
    cfg = get_defaults().DATA
    for key, value in split_overrides.items():
        cfg.TRAIN[key] = value
    return cfg


def _small_multicrop(split_cfg, counts=(2, 3), sizes=(16, 8)):
    split_cfg.TRANSFORMS.NUM_CROPS = list(counts)
    split_cfg.TRANSFORMS.SIZE_CROPS = list(sizes)
    split_cfg.TRANSFORMS.CROP_SCALES = [[0.3, 1.0]] * len(counts)
    split_cfg.TRANSFORMS.SOLARIZE_PROB = 0.2
    return split_cfg


def _write_png(path, value=128, side=12):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    Image.new("RGB", (side, side), (value, 255 - value, value // 2)).save(path)


# ------------------------------------------------------------------------------------ sampler
@pytest.mark.parametrize("world", [1, 2, 3, 4, 5])
@pytest.mark.parametrize("num_samples", [5, 13, 23, 40])
@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("shuffle", [False, True])
def test_sampler_partition(world, num_samples, batch, shuffle):
    def parts(epoch, drop_last):
        return [
            rank_indices(num_samples, world, r, batch, 7, epoch, shuffle, drop_last) for r in range(world)
        ]

    # drop_last: disjoint, whole batches only, equal lengths, the dropped tail smaller than a global batch
    if num_samples >= batch * world:
        dropped = parts(0, True)
        flat = [i for part in dropped for i in part]
        assert len(flat) == len(set(flat)), "duplicates with DROP_LAST"
        assert {len(p) for p in dropped} == {len(dropped[0])} and len(dropped[0]) % batch == 0
        assert num_samples - len(flat) < batch * world
    else:
        with pytest.raises(ValueError, match="no full batch"):
            DistributedSampler(num_samples, batch, shuffle, drop_last=True, rank=0, world_size=world)
    # padding: every sample seen, equal lengths, exactly the padding repeated
    padded = parts(0, False)
    flat = [i for part in padded for i in part]
    per_rank = -(-num_samples // world)
    assert all(len(p) == per_rank for p in padded)
    assert set(flat) == set(range(num_samples))
    assert len(flat) - len(set(flat)) == per_rank * world - num_samples
    # the order depends only on (seed, epoch)
    assert parts(0, False) == padded
    if shuffle and num_samples > 5:
        assert parts(1, False) != padded


def test_sampler_global_order_is_world_size_independent():
    # iteration t of all ranks together is the block order[t*B*W : (t+1)*B*W] for every world size
    n, batch, seed, epoch = 37, 2, 3, 5
    full = rank_indices(n, 1, 0, batch * 1, seed, epoch, True, True)
    for world in (2, 3, 4):
        parts = [rank_indices(n, world, r, batch, seed, epoch, True, True) for r in range(world)]
        for t in range(len(parts[0]) // batch):
            block = {i for p in parts for i in p[t * batch : (t + 1) * batch]}
            assert block == set(full[t * batch * world : (t + 1) * batch * world])


@pytest.mark.parametrize("world", [1, 2, 3, 4, 5])
@pytest.mark.parametrize("drop_last", [False, True])
def test_sampler_resume_mid_epoch(world, drop_last):
    for rank in range(world):
        sampler = DistributedSampler(29, 2, True, drop_last, seed=1, rank=rank, world_size=world)
        sampler.set_epoch(4)
        full = list(sampler)
        assert all(epoch == 4 for _, epoch in full) and len(full) == len(sampler)
        for start in range(sampler.num_batches() + 1):
            sampler.set_epoch(4, start_iteration=start)
            assert list(sampler) == full[start * 2 :]
    with pytest.raises(ValueError, match="start_iteration"):
        sampler.set_epoch(0, start_iteration=sampler.num_batches() + 1)


def test_loader_resume_yields_the_same_batches():
    cfg = _data_cfg(SYNTHETIC_SIZE=21, BATCHSIZE_PER_REPLICA=4, IMAGE_SIZE=16)
    _small_multicrop(cfg.TRAIN)
    loader = build_loader(cfg, "TRAIN", seed=3, device=CPU, rank=1, world_size=2)
    assert len(loader) == 2  # 21 samples, 2 ranks x 4 -> 2 full batches per rank
    set_epoch(loader, 2)
    full = list(loader)
    set_epoch(loader, 2, start_iteration=1)
    resumed = list(loader)
    assert len(resumed) == 1 and len(loader) == 2
    assert torch.equal(resumed[0]["index"], full[1]["index"])
    assert all(torch.equal(a, b) for a, b in zip(resumed[0]["crops"], full[1]["crops"]))


# ------------------------------------------------------------------ transforms and collate
def test_multicrop_shapes_and_collate_layout():
    cfg = _data_cfg(SYNTHETIC_SIZE=10, IMAGE_SIZE=20, BATCHSIZE_PER_REPLICA=4)
    _small_multicrop(cfg.TRAIN, counts=(2, 3), sizes=(16, 8))
    batch = next(iter(build_loader(cfg, "TRAIN", seed=0, device=CPU)))
    assert [tuple(c.shape) for c in batch["crops"]] == [(4, 3, 16, 16)] * 2 + [(4, 3, 8, 8)] * 3
    assert all(c.dtype == torch.float32 for c in batch["crops"])
    assert batch["label"].dtype == torch.long and batch["label"].shape == (4,)
    assert batch["index"].dtype == torch.long and batch["index"].shape == (4,)
    assert torch.equal(batch["label"], batch["index"] % 10) and batch["num_skipped"] == 0
    assert not torch.equal(batch["crops"][0], batch["crops"][1]), "two views of one image must differ"


def test_eval_transform_gives_one_center_crop():
    cfg = get_defaults().DATA
    cfg.TEST.SYNTHETIC_SIZE, cfg.TEST.TRANSFORMS.RESIZE, cfg.TEST.TRANSFORMS.CENTER_CROP = 5, 24, 20
    loader = build_loader(cfg, "TEST", seed=0, device=CPU)
    batch = next(iter(loader))
    assert len(batch["crops"]) == 1 and batch["crops"][0].shape == (5, 3, 20, 20)
    assert batch["index"].tolist() == [0, 1, 2, 3, 4]
    again = next(iter(loader))  # no randomness in eval
    assert torch.equal(again["crops"][0], batch["crops"][0])


def test_views_depend_only_on_seed_epoch_index():
    cfg = _small_multicrop(_data_cfg(SYNTHETIC_SIZE=8, IMAGE_SIZE=16).TRAIN)
    dataset = build_dataset(cfg, seed=5)
    state = torch.get_rng_state()
    first = dataset.views((3, 1))
    assert torch.equal(torch.get_rng_state(), state), "the global RNG must be left untouched"
    assert all(torch.equal(a, b) for a, b in zip(first, dataset.views((3, 1))))
    assert not torch.equal(first[0], dataset.views((3, 2))[0])
    assert not torch.equal(first[0], build_dataset(cfg, seed=6).views((3, 1))[0])
    # a view is the same in any batch: alone, or among others
    batch = dataset.collate([dataset[(i, 1)] for i in (5, 3, 0)])
    for k, view in enumerate(first):
        torch.testing.assert_close(batch["crops"][k][1], view, rtol=0, atol=1e-6)


def test_worker_processes_give_the_same_batches():
    # persistent workers never see set_epoch: the epoch travels with each index
    cfg = _data_cfg(SYNTHETIC_SIZE=12, IMAGE_SIZE=16, BATCHSIZE_PER_REPLICA=3)
    _small_multicrop(cfg.TRAIN, counts=(1,), sizes=(8,))
    epochs = {}
    for workers in (0, 2):
        cfg.NUM_DATALOADER_WORKERS = workers
        loader = build_loader(cfg, "TRAIN", seed=0, device=CPU)
        assert loader.persistent_workers == (workers > 0) and not loader.pin_memory
        epochs[workers] = []
        for epoch in (0, 1):
            loader.sampler.set_epoch(epoch)
            epochs[workers].append(torch.cat([b["crops"][0] for b in loader]))
    assert not torch.equal(epochs[0][0], epochs[0][1])
    assert all(torch.equal(a, b) for a, b in zip(epochs[0], epochs[2]))


def test_batches_of_mixed_sizes_and_modes(tmp_path):
    # RGB and grayscale images of three sizes in one batch: each view as it would be alone
    for i, (side, mode) in enumerate([(12, "RGB"), (20, "L"), (12, "L"), (31, "RGB"), (20, "RGB")]):
        os.makedirs(tmp_path / "c", exist_ok=True)
        Image.fromarray(np.random.default_rng(i).integers(0, 256, (side, side + i, 3), np.uint8)).convert(
            mode
        ).save(tmp_path / "c" / f"{i}.png")
    cfg = _small_multicrop(_data_cfg(DATA_SOURCES=["disk_folder"], DATA_PATHS=[str(tmp_path)]).TRAIN)
    dataset = build_dataset(cfg, seed=2)
    batch = dataset.collate([dataset[(i, 0)] for i in range(5)])
    assert [tuple(c.shape) for c in batch["crops"]] == [(5, 3, 16, 16)] * 2 + [(5, 3, 8, 8)] * 3
    for i in range(5):
        for k, view in enumerate(dataset.views((i, 0))):
            torch.testing.assert_close(batch["crops"][k][i], view, rtol=0, atol=1e-6)
    with pytest.raises(ValueError, match="empty batch"):
        dataset.collate([])


def test_bad_config_names_valid_choices():
    cfg = _data_cfg(DATA_SOURCES=["imagenet"])
    with pytest.raises(ValueError, match="valid sources.*disk_folder"):
        build_dataset(cfg.TRAIN)
    cfg = _data_cfg()
    cfg.TRAIN.TRANSFORMS.NAME = "simclr"
    with pytest.raises(ValueError, match="valid names.*eval.*multicrop"):
        build_dataset(cfg.TRAIN)
    cfg.TRAIN.TRANSFORMS.NAME = "multicrop"
    cfg.TRAIN.TRANSFORMS.SIZE_CROPS = [32, 16]
    with pytest.raises(ValueError, match="one entry per resolution"):
        build_dataset(cfg.TRAIN)
    with pytest.raises(ValueError, match="valid splits"):
        build_loader(get_defaults().DATA, "VAL", 0, CPU)


# ------------------------------------------------------------------------------- sources
def test_concat_and_limit():
    cfg = _data_cfg(DATA_SOURCES=["synthetic", "synthetic"], DATA_PATHS=[""], SYNTHETIC_SIZE=6)
    assert len(build_dataset(cfg.TRAIN)) == 12
    cfg.TRAIN.DATA_LIMIT = 8
    dataset = build_dataset(cfg.TRAIN)
    assert len(dataset) == 8 and dataset.targets == [0, 1, 2, 3, 4, 5, 0, 1]
    assert dataset[7]["label"] == 1


def test_count_samples_reads_no_image_and_writes_no_demo_cache(tmp_path):
    cfg = _data_cfg(DATA_SOURCES=["synthetic", "demo_digits"], DATA_PATHS=[""], SYNTHETIC_SIZE=6, SPLIT="val")
    cfg.TRAIN.DATA_LIMIT = 300
    assert count_samples(cfg.TRAIN) == 300
    cfg.TRAIN.DATA_LIMIT = -1
    cfg.CACHE_DIR = str(tmp_path / "cache")
    assert count_samples(cfg.TRAIN) == 6 + 360
    assert not (tmp_path / "cache").exists()
    assert len(build_dataset(cfg.TRAIN, cache_dir=cfg.CACHE_DIR)) == 366  # the demo cache, written now
    cfg.TRAIN.DATA_LIMIT = 0
    with pytest.raises(DataError, match="holds no samples"):
        count_samples(cfg.TRAIN)


def test_disk_folder_split_and_missing_path(tmp_path):
    for split, value in (("train", 10), ("val", 200)):
        for cls in ("cat", "dog"):
            _write_png(str(tmp_path / split / cls / "a.png"), value)
    cfg = _data_cfg(DATA_SOURCES=["disk_folder"], DATA_PATHS=[str(tmp_path)])
    cfg.TRAIN.SPLIT = "val"
    dataset = build_dataset(cfg.TRAIN)
    assert len(dataset) == 2 and dataset.targets == [0, 1]
    assert dataset.sources[0].paths[0] == str(tmp_path / "val" / "cat" / "a.png")
    cfg.TRAIN.SPLIT = "test"
    with pytest.raises(ValueError, match="SPLIT 'test'"):
        build_dataset(cfg.TRAIN)
    missing = str(tmp_path / "nowhere")
    cfg.TRAIN.DATA_PATHS = [missing]
    with pytest.raises(DataError, match=missing):
        build_dataset(cfg.TRAIN)


def test_filelist_source(tmp_path):
    _write_png(str(tmp_path / "imgs" / "x.png"), 10)
    _write_png(str(tmp_path / "other" / "y z.png"), 90)
    listing = tmp_path / "lists" / "train.txt"
    listing.parent.mkdir()
    listing.write_text(f"# comment\n../imgs/x.png 3\n\n{tmp_path / 'other' / 'y z.png'} 7\n")
    cfg = _data_cfg(DATA_SOURCES=["disk_filelist"], DATA_PATHS=[str(listing)])
    dataset = build_dataset(cfg.TRAIN)
    assert dataset.targets == [3, 7] and dataset[(1, 0)]["label"] == 7
    listing.write_text("../imgs/x.png cat\n")
    with pytest.raises(ValueError, match="train.txt:1"):
        build_dataset(cfg.TRAIN)
    cfg.TRAIN.DATA_PATHS = [str(tmp_path / "missing.txt")]
    with pytest.raises(DataError, match="missing.txt"):
        build_dataset(cfg.TRAIN)


def _folder_with_bad_images(root):
    for i in range(6):
        _write_png(os.path.join(root, "a" if i % 2 else "b", f"{i}.png"), 20 * i)
    garbage = os.path.join(root, "a", "3.png")
    with open(garbage, "wb") as handle:
        handle.write(b"not an image at all")
    truncated = os.path.join(root, "b", "4.png")
    with open(truncated, "rb") as handle:
        data = handle.read()
    with open(truncated, "wb") as handle:
        handle.write(data[: len(data) // 2])
    return [garbage, truncated]


def test_corrupt_images_raise_naming_the_file(tmp_path):
    bad = _folder_with_bad_images(str(tmp_path))
    cfg = _data_cfg(DATA_SOURCES=["disk_folder"], DATA_PATHS=[str(tmp_path)])
    dataset = build_dataset(cfg.TRAIN)
    paths = dataset.sources[0].paths
    for i, path in enumerate(paths):
        if path in bad:
            with pytest.raises(CorruptImageError, match=f"cannot read image {path}"):
                dataset[i]
        else:
            assert dataset[i]["index"] == i
    assert dataset.num_skipped == 0
    # raised inside a DataLoader worker, the error keeps its type and its one line (no worker
    # traceback in the message), naming the file and the switch that skips it
    cfg.NUM_DATALOADER_WORKERS, cfg.TRAIN.BATCHSIZE_PER_REPLICA = 1, 6
    batches = iter(build_loader(cfg, "TRAIN", seed=0, device=CPU))
    with pytest.raises(CorruptImageError) as info:
        next(batches)
    assert re.fullmatch(
        r"cannot read image \S+\.png: .*; set DATA\.TRAIN\.SKIP_CORRUPT=True to skip unreadable images",
        str(info.value),
    )
    batches._shutdown_workers()  # now, rather than whenever the traceback is collected


def test_corrupt_images_skipped_and_counted(tmp_path, caplog):
    bad = _folder_with_bad_images(str(tmp_path))
    cfg = get_defaults().DATA
    cfg.TEST.DATA_SOURCES, cfg.TEST.DATA_PATHS = ["disk_folder"], [str(tmp_path)]
    cfg.TEST.SKIP_CORRUPT, cfg.TEST.BATCHSIZE_PER_REPLICA = True, 4
    cfg.TEST.TRANSFORMS.RESIZE = cfg.TEST.TRANSFORMS.CENTER_CROP = 8
    # the dataset's own count is kept by the process that loads: this one, whatever the automatic
    # worker count makes of the threads other tests left to this pytest worker
    cfg.NUM_DATALOADER_WORKERS = 0
    loader = build_loader(cfg, "TEST", seed=0, device=CPU)
    with caplog.at_level(logging.WARNING):
        batches = list(loader)
    assert sum(b["num_skipped"] for b in batches) == 2 and loader.dataset.num_skipped == 2
    paths = loader.dataset.sources[0].paths
    seen = torch.cat([b["index"] for b in batches]).tolist()
    assert all(paths[i] not in bad for i in seen) and len(seen) == 6
    assert all(any(p in r.getMessage() for r in caplog.records) for p in bad)


def test_missing_listed_image(tmp_path):
    _write_png(str(tmp_path / "ok.png"))
    listing = tmp_path / "list.txt"
    listing.write_text("ok.png 0\ngone.png 1\n")
    cfg = _data_cfg(DATA_SOURCES=["disk_filelist"], DATA_PATHS=[str(listing)])
    with pytest.raises(
        CorruptImageError, match="image file not found: .*gone.png.*DATA.TRAIN.SKIP_CORRUPT=True"
    ):
        build_dataset(cfg.TRAIN)[1]
    cfg.TRAIN.SKIP_CORRUPT = True
    sample = build_dataset(cfg.TRAIN)[1]
    assert sample["skipped"] == 1 and sample["index"] == 0  # replaced by the next readable sample


# --------------------------------------------------------------------------- demo digits
@pytest.fixture(scope="module")
def demo_cache(tmp_path_factory):
    cache = str(tmp_path_factory.mktemp("cache"))
    ensure_demo_digits(cache)
    return cache


def _count_pngs(root):
    return sum(f.endswith(".png") for _, _, files in os.walk(root) for f in files)


def test_demo_digits_is_idempotent_and_complete(demo_cache):
    root = ensure_demo_digits(demo_cache)
    meta = os.path.join(root, "META.json")
    stamp = os.stat(meta).st_mtime_ns
    assert ensure_demo_digits(demo_cache) == root and os.stat(meta).st_mtime_ns == stamp
    assert _count_pngs(root) == 1797
    sizes = {}
    for split in ("train", "val"):
        cfg = _data_cfg(DATA_SOURCES=["demo_digits"], SPLIT=split)
        cfg.CACHE_DIR = demo_cache
        dataset = build_dataset(cfg.TRAIN)
        sizes[split] = len(dataset)
        assert sorted(set(dataset.targets)) == list(range(10))
    assert sizes == {"train": 1437, "val": 360}
    with Image.open(
        os.path.join(root, "val", "0", sorted(os.listdir(os.path.join(root, "val", "0")))[0])
    ) as image:
        assert image.size == (32, 32) and image.mode == "RGB"
    assert [e for e in os.listdir(demo_cache) if ".tmp-" in e] == []


def test_demo_digits_crash_leaves_no_half_set(tmp_path, monkeypatch):
    original, calls = demo._digit_to_image, []

    def failing(pixels):
        calls.append(1)
        if len(calls) > 100:
            raise KeyboardInterrupt("simulated crash")
        return original(pixels)

    monkeypatch.setattr(demo, "_digit_to_image", failing)
    with pytest.raises(KeyboardInterrupt):
        ensure_demo_digits(str(tmp_path))
    assert not os.path.exists(demo.demo_digits_root(str(tmp_path)))
    assert [e for e in os.listdir(tmp_path) if ".tmp-" in e] == []


def test_demo_digits_losing_the_rename_race_is_harmless(tmp_path):
    root = str(tmp_path / "demo_digits")
    for name in ("first", "second"):
        os.makedirs(tmp_path / name)
        (tmp_path / name / "META.json").write_text(name)
    demo._publish(str(tmp_path / "first"), root)
    demo._publish(str(tmp_path / "second"), root)  # another writer got there first: discard ours
    assert (tmp_path / "demo_digits" / "META.json").read_text() == "first"
    assert not (tmp_path / "second").exists()


def _ensure_on_rank(rank, world, cache):
    root = ensure_demo_digits(cache)
    return _count_pngs(root)


def test_demo_digits_concurrent_ranks(tmp_path):
    assert run_on_ranks(_ensure_on_rank, 3, str(tmp_path)) == [1797] * 3
    assert sorted(e for e in os.listdir(tmp_path) if not e.endswith(".lock")) == ["demo_digits"]


def test_demo_digits_are_read_without_importing_sklearn_here(tmp_path):
    """scikit-learn and SciPy stay out of the rank that writes the set (77 MiB it would keep)."""
    code = (
        "import sys; from vistrain.data.demo_digits import ensure_demo_digits; "
        f"ensure_demo_digits({str(tmp_path)!r}); print(sorted(m for m in ('sklearn', 'scipy') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
    assert (tmp_path / "demo_digits" / "META.json").is_file()


def test_demo_digits_child_failure_is_one_line(tmp_path, monkeypatch):
    broken = tmp_path / "broken" / "sklearn"
    broken.mkdir(parents=True)
    (broken / "__init__.py").write_text("raise ImportError('no scikit-learn here')\n")
    monkeypatch.setenv("PYTHONPATH", str(broken.parent))
    with pytest.raises(
        RuntimeError, match="reading scikit-learn's digits failed: ImportError: no scikit-learn here"
    ):
        ensure_demo_digits(str(tmp_path / "cache"))
    assert not os.path.exists(demo.demo_digits_root(str(tmp_path / "cache")))


# ------------------------------------------------------------------- multi-rank (gloo)
def _rank_batches(rank, world):
    cfg = _data_cfg(SYNTHETIC_SIZE=17, IMAGE_SIZE=16, BATCHSIZE_PER_REPLICA=2, DROP_LAST=False)
    _small_multicrop(cfg.TRAIN, counts=(1,), sizes=(8,))
    loader = build_loader(cfg, "TRAIN", seed=11, device=CPU)  # rank and world from torch.distributed
    set_epoch(loader, 3)
    batches = list(loader)
    return {
        "index": torch.cat([b["index"] for b in batches]),
        "crops": torch.cat([b["crops"][0] for b in batches]),
        "len": len(loader),
    }


def test_loader_on_gloo_ranks_matches_single_process():
    world = 3
    results = run_on_ranks(_rank_batches, world)
    for rank, result in enumerate(results):
        cfg = _data_cfg(SYNTHETIC_SIZE=17, IMAGE_SIZE=16, BATCHSIZE_PER_REPLICA=2, DROP_LAST=False)
        _small_multicrop(cfg.TRAIN, counts=(1,), sizes=(8,))
        reference = build_loader(cfg, "TRAIN", seed=11, device=CPU, rank=rank, world_size=world)
        set_epoch(reference, 3)
        batches = list(reference)
        assert result["len"] == len(reference) == 3
        assert torch.equal(result["index"], torch.cat([b["index"] for b in batches]))
        assert torch.equal(result["crops"], torch.cat([b["crops"][0] for b in batches]))
    indices = torch.cat([r["index"] for r in results]).tolist()
    assert set(indices) == set(range(17)) and len(indices) == 18  # one padded repeat


# ------------------------------------------------------------------ geometric (digit) augmentations
def _square_image(side=32, lo=12, hi=20):
    pixels = np.zeros((side, side, 3), dtype=np.uint8)
    pixels[lo:hi, lo:hi] = 255
    return pixels


def _whole_image_views(**geometric):
    cfg = get_defaults().DATA.TRAIN.TRANSFORMS
    cfg.update(NUM_CROPS=[1], SIZE_CROPS=[32], CROP_SCALES=[[1.0, 1.0]], HORIZONTAL_FLIP=0.0)
    cfg.update(COLOR_DISTORTION=0.0, BLUR_PROB=0.0, MEAN=[0.0] * 3, STD=[1.0] * 3, **geometric)
    return MultiCropTransform(cfg)


def _view(transform, image, seed=0):
    """The first view (3, h, w) of ``image`` (uint8 array) with the draws of generator ``seed``."""
    return transform([transform.prepare(image, torch.Generator().manual_seed(seed))])[0][0]


def _centroid(view):
    grey = view[0]
    ys, xs = torch.meshgrid(torch.arange(32.0), torch.arange(32.0), indexing="ij")
    return torch.stack([(grey * ys).sum(), (grey * xs).sum()]) / grey.sum()


def test_geometric_augmentations_move_the_glyph_within_their_bounds():
    image = _square_image()
    plain = _whole_image_views()
    assert plain.affine is None and plain.elastic is None  # off by default
    reference = _view(plain, image)
    assert torch.equal(reference, _view(plain, image, seed=1))  # no geometric step: the whole image
    assert torch.equal(reference, torch.from_numpy(image).permute(2, 0, 1) / 255)  # unchanged
    shifted = _whole_image_views(AFFINE_TRANSLATE=0.25)
    shifts = torch.stack(
        [_centroid(_view(shifted, image, seed)) - _centroid(reference) for seed in range(20)]
    )
    assert shifts.abs().max() <= 0.25 * 32 + 0.5 and shifts.abs().max() > 2  # moved, up to 8 px
    rotated = _view(_whole_image_views(AFFINE_DEGREES=45.0), image)
    assert rotated.min() == 0 and not torch.equal(rotated, reference)  # black fill, new pose
    elastic = _view(_whole_image_views(ELASTIC_PROB=1.0, ELASTIC_ALPHA=30.0, ELASTIC_SIGMA=3.0), image)
    assert not torch.equal(elastic, reference)
    assert abs(elastic.sum() - reference.sum()) < 0.25 * reference.sum()  # distorted, not erased


@pytest.mark.parametrize(
    "bad, message",
    [
        ({"AFFINE_DEGREES": -5.0}, "AFFINE_DEGREES"),
        ({"AFFINE_TRANSLATE": 1.5}, "AFFINE_TRANSLATE"),
        ({"AFFINE_SCALE": [1.2, 1.1]}, "AFFINE_SCALE"),
        ({"ELASTIC_SIGMA": 0.0}, "ELASTIC_SIGMA"),
        ({"ELASTIC_PROB": 2.0}, "ELASTIC_PROB"),
    ],
)
def test_bad_geometric_settings_are_named(bad, message):
    with pytest.raises(ValueError, match=message):
        _whole_image_views(**bad)
