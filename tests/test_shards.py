"""Tar shards (vistrain/data/shards.py, tools/make_shards.py): the shards hold the folder's bytes, the
epoch rule over many sizes and world sizes, loading on 2 and 3 ranks with workers, the resume,
corrupt members, shards of other tools, and the one-line errors."""

import os
import re
import runpy
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from vistrain.config import ConfigError, DataError
from vistrain.data import CorruptImageError, build_dataset, build_loader, set_epoch
from vistrain.data.datasets import count_samples
from vistrain.data.folders import read_image
from vistrain.data.sampler import DistributedSampler, samples_per_rank
from vistrain.data.shards import ShardSampler, epoch_stream, rank_shard_indices
from vistrain.methods import get_defaults

REPO = Path(__file__).resolve().parents[1]
CPU = torch.device("cpu")
CLASSES = ("cat", "dog", "eel")
NUM_IMAGES = 23  # 5 shards of --per-shard 5: 5, 5, 5, 5, 3


def _make_shards(capsys, *args):
    """tools/make_shards.py's main() in this process: (exit code, stdout, stderr)."""
    capsys.readouterr()
    code = runpy.run_path(str(REPO / "tools" / "make_shards.py"))["main"]([str(a) for a in args])
    out = capsys.readouterr()
    return code, out.out, out.err


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """23 small PNGs in 3 class folders, of sizes and modes that differ, one file name with dots."""
    root = tmp_path_factory.mktemp("photos")
    rng = np.random.default_rng(0)
    for i in range(NUM_IMAGES):
        os.makedirs(root / CLASSES[i % 3], exist_ok=True)
        side = 8 + i % 5
        mode = "L" if i % 4 == 0 else "RGB"
        name = "v1.2.png" if i == 7 else f"{i:03d}.png"
        Image.fromarray(rng.integers(0, 256, (side, side, 3), np.uint8)).convert(mode).save(
            root / CLASSES[i % 3] / name
        )
    return root


@pytest.fixture(scope="module")
def shards(folder, tmp_path_factory):
    """The folder as 5 shards (its DATA_PATHS pattern); written once for the module."""
    out = tmp_path_factory.mktemp("shards")
    code = runpy.run_path(str(REPO / "tools" / "make_shards.py"))["main"](
        [str(folder), str(out), "--per-shard", "5"]
    )
    assert code == 0
    return str(out / f"{folder.name}-{{000000..000004}}.tar")


def _data_cfg(pattern, batch=2, workers=0, **split):
    cfg = get_defaults().DATA
    cfg.NUM_DATALOADER_WORKERS = workers
    train = cfg.TRAIN
    train.DATA_SOURCES, train.DATA_PATHS, train.BATCHSIZE_PER_REPLICA = ["webdataset"], [pattern], batch
    train.SHUFFLE_WINDOW = 4
    train.TRANSFORMS.NUM_CROPS, train.TRANSFORMS.SIZE_CROPS = [1], [8]
    train.TRANSFORMS.BLUR_PROB = train.TRANSFORMS.COLOR_DISTORTION = 0.0  # crops and flips: enough to compare
    for key, value in split.items():
        train[key] = value
    return cfg


# ---------------------------------------------------------------------------- make_shards
def test_make_shards_stores_the_files_bytes_and_labels(folder, shards, tmp_path, capsys):
    dataset = build_dataset(_data_cfg(shards).TRAIN)
    source = dataset.sources[0]
    assert source.shard_sizes == [5, 5, 5, 5, 3] and count_samples(_data_cfg(shards).TRAIN) == NUM_IMAGES
    files = set()
    for i in range(NUM_IMAGES):
        key, ext_and_shard = source.describe(i).split(".", 1)  # "cat/003.png in shard ..."
        name = "v1.2.png" if key.endswith("v1_2") else key.split("/")[1] + ".png"
        path = folder / key.split("/")[0] / name
        files.add(path)
        assert ext_and_shard.startswith("png in shard ") and source.read_bytes(i) == path.read_bytes()
        assert source.labels[i] == CLASSES.index(key.split("/")[0])
        assert np.array_equal(source.load(i)[0], np.array(read_image(str(path), "RGB")))
        if i == 0:  # a source read as grayscale
            source.mode = "L"
            assert np.array_equal(source.load(i)[0], np.array(read_image(str(path), "L")))
            source.mode = "RGB"
    assert len(files) == NUM_IMAGES  # every image once
    out = Path(shards).parent
    assert (out / f"{folder.name}-classes.txt").read_text().split() == list(CLASSES)
    # unlabelled, split by bytes: each shard but the last holds at least --max-bytes of images
    code, printed, _ = _make_shards(capsys, folder, tmp_path / "u", "--labels", "none", "--max-bytes", 2000)
    assert code == 0 and re.match(rf"wrote \d+ shards to {tmp_path / 'u'}: 23 samples, unlabelled", printed)
    pattern = re.search(r'DATA_PATHS=\["(.*)"\]', printed).group(1)
    unlabelled = build_dataset(_data_cfg(pattern).TRAIN).sources[0]
    assert unlabelled.labels == [-1] * NUM_IMAGES
    starts = np.cumsum([0] + unlabelled.shard_sizes)
    for first, last in zip(starts[:-2], starts[1:-1]):
        assert unlabelled.sizes[first:last].sum() >= 2000 > unlabelled.sizes[first : last - 1].sum()
    # the same OUT again: refused in one line, nothing overwritten
    code, _, err = _make_shards(capsys, folder, tmp_path / "u", "--labels", "none")
    assert code == 2 and err.splitlines() == [
        f"data error: make_shards: {tmp_path / 'u'} already holds {folder.name}-*.tar shards; choose another OUT or --name"
    ]


def test_shards_of_other_tools_need_an_index(tmp_path, capsys):
    import webdataset

    pattern = str(tmp_path / "w-{0..1}.tar")
    for n in range(2):
        with webdataset.TarWriter(str(tmp_path / f"w-{n}.tar")) as sink:
            for i in range(3):
                pixels = np.full((6, 6, 3), 40 * i + n, np.uint8)  # mask.png: before png, not the image
                sink.write(
                    {"__key__": f"d.{n}/s{i}", "png": pixels, "mask.png": pixels * 0, "json": {"i": i}}
                )
    cfg = _data_cfg(pattern).TRAIN
    with pytest.raises(DataError, match=re.escape(f"make_shards.py --index-only '{pattern}'")):
        build_dataset(cfg)
    code, printed, _ = _make_shards(capsys, "--index-only", pattern)
    assert code == 0 and printed == "indexed 2 shards: 6 samples\n"
    source = build_dataset(cfg).sources[0]
    assert source.labels == [-1] * 6 and source.describe(4) == f"d.1/s1.png in shard {tmp_path / 'w-1.tar'}"
    assert np.array_equal(source.load(4)[0], np.full((6, 6, 3), 41, np.uint8))


# ---------------------------------------------------------------------------- the epoch rule
SIZES = [[7], [5, 5, 5, 5, 3], [1, 9, 2, 8, 4], [3] * 11, [0, 6, 13, 0, 2], [40, 1, 1]]


@pytest.mark.parametrize("sizes", SIZES, ids=str)
def test_epoch_rule(sizes):
    total = sum(sizes)
    combos = [
        (w, b, d, s, k)
        for w in (1, 2, 3, 7)
        for b in (1, 4)
        for d in (True, False)
        for s in (True, False)
        for k in (3, 64)
    ]
    for world, batch, drop_last, shuffle, window in combos:
        per_rank = samples_per_rank(total, world, batch, drop_last)
        dropped = set()
        for epoch in range(3 if shuffle else 1):
            stream = epoch_stream(sizes, 9, epoch, shuffle).tolist()
            assert sorted(stream) == list(range(total))
            parts = [
                rank_shard_indices(sizes, world, r, batch, 9, epoch, shuffle, drop_last, window)
                for r in range(world)
            ]
            for rank, mine in enumerate(parts):
                assert len(mine) == per_rank  # every rank the same number of steps
                span = [stream[q % total] for q in range(rank * per_rank, (rank + 1) * per_rank)]
                if not shuffle:
                    assert mine == span  # the pattern's order, rank parts one after the other
                for start in range(0, per_rank, window):  # each window: its stretch of the stream
                    assert sorted(mine[start : start + window]) == sorted(span[start : start + window])
            flat = [i for mine in parts for i in mine]
            if drop_last:
                assert len(set(flat)) == len(flat) and total - len(flat) < world * batch
                dropped.add(frozenset(range(total)) - frozenset(flat))
            else:
                assert set(flat) == set(range(total)) and len(flat) == -(-total // world) * world
        if shuffle and drop_last and total > world * batch and total % (world * batch):
            assert len(dropped) > 1, "the samples left out must change from epoch to epoch"
    again = rank_shard_indices(sizes, 3, 1, 1, 9, 2, True, False, 5)
    assert again == rank_shard_indices(sizes, 3, 1, 1, 9, 2, True, False, 5)


def test_a_rank_reads_its_own_stretch_of_the_shards():
    sizes = [100] * 30
    shard_of = np.repeat(np.arange(30), 100)
    for rank in range(3):
        touched = set(shard_of[rank_shard_indices(sizes, 3, rank, 8, 0, 5, True, True, 50)])
        assert len(touched) <= 11  # 10 shards' worth of samples, starting anywhere in a shard


# ---------------------------------------------------------------------------- real loading
def _epoch(cfg, rank, world, epoch=1, start=0):
    loader = build_loader(cfg, "TRAIN", seed=4, device=CPU, rank=rank, world_size=world)
    set_epoch(loader, epoch, start)
    batches = list(loader)
    return loader, batches


@pytest.mark.parametrize("world, workers", [(2, 0), (3, 2)])
def test_loading_on_ranks_keeps_the_rule(shards, world, workers, one_thread):
    cfg = _data_cfg(shards, batch=2, workers=workers, DROP_LAST=True)
    seen, lengths = [], set()
    for rank in range(world):
        loader, batches = _epoch(cfg, rank, world)
        assert isinstance(loader.sampler, ShardSampler) and loader.persistent_workers == (workers > 0)
        expected = rank_shard_indices([5, 5, 5, 5, 3], world, rank, 2, 4, 1, True, True, 4)
        assert torch.cat([b["index"] for b in batches]).tolist() == expected
        assert all(len(b["index"]) == 2 for b in batches)
        lengths.add((len(loader), len(batches)))
        seen += expected
    assert len(lengths) == 1 and len(set(seen)) == len(seen) == NUM_IMAGES // (2 * world) * 2 * world
    if workers:  # the same views with and without workers
        _, alone = _epoch(_data_cfg(shards, batch=2, workers=0, DROP_LAST=True), world - 1, world)
        assert all(torch.equal(a["crops"][0], b["crops"][0]) for a, b in zip(alone, batches))


def test_resume_continues_with_the_batches_of_the_uninterrupted_run(shards, one_thread):
    cfg = _data_cfg(shards, batch=2, workers=2, DROP_LAST=False)
    _, full = _epoch(cfg, 2, 3, epoch=3)
    assert len(full) == 4  # ceil(23 / 3) = 8 samples per rank
    _, resumed = _epoch(cfg, 2, 3, epoch=3, start=1)  # a new loader, as after a kill
    assert len(resumed) == 3
    for a, b in zip(full[1:], resumed):
        assert torch.equal(a["index"], b["index"]) and torch.equal(a["crops"][0], b["crops"][0])


def test_mixed_sources_take_the_folders_order(shards):
    cfg = _data_cfg(shards)
    cfg.TRAIN.DATA_SOURCES, cfg.TRAIN.DATA_PATHS = ["webdataset", "synthetic"], [shards, ""]
    assert type(build_loader(cfg, "TRAIN", seed=0, device=CPU).sampler) is DistributedSampler


# ---------------------------------------------------------------------------- bad data
def test_a_corrupt_member_stops_or_is_skipped_and_counted(shards, tmp_path, one_thread):
    for shard in Path(shards).parent.glob("*.tar*"):
        shutil.copy(shard, tmp_path / shard.name)
    pattern = str(tmp_path / Path(shards).name)
    source = build_dataset(_data_cfg(pattern).TRAIN).sources[0]
    bad = 7
    with open(source.shards[1], "r+b") as handle:  # sample 7: the third of shard 1
        handle.seek(int(source.offsets[bad]))
        handle.write(b"\0" * int(source.sizes[bad]))
    where = re.escape(source.describe(bad))
    with pytest.raises(
        CorruptImageError, match=f"cannot read image {where}: .*; set DATA.TRAIN.SKIP_CORRUPT=True"
    ):
        build_dataset(_data_cfg(pattern).TRAIN)[bad]
    cfg = _data_cfg(pattern, batch=4, DROP_LAST=False, SKIP_CORRUPT=True)
    cfg.TRAIN.SHUFFLE = False
    _, batches = _epoch(cfg, 0, 1)
    indices = torch.cat([b["index"] for b in batches]).tolist()
    assert sum(b["num_skipped"] for b in batches) == 1 and [len(b["index"]) for b in batches] == [4] * 5 + [3]
    assert indices == [i + (i == bad) for i in range(NUM_IMAGES)]  # replaced by the next sample
    # a shard cut short no longer matches its index: refused naming the command that rewrites it
    with open(source.shards[4], "r+b") as handle:
        handle.truncate(1024)
    with pytest.raises(
        DataError, match=r"the shard changed\); rewrite the index: python tools/make_shards.py --index-only"
    ):
        build_dataset(_data_cfg(pattern).TRAIN)


def test_input_errors_are_one_line(shards, tmp_path, monkeypatch, capsys):
    for path, message in [
        ("", "webdataset needs a brace pattern of tar shards in DATA_PATHS"),
        (str(tmp_path), f"DATA_PATHS entry {tmp_path} is a folder; give a brace pattern of its shards"),
        (shards.replace("000004", "000005"), "shard not found: .*-000005.tar"),
    ]:
        with pytest.raises(DataError if path else ConfigError, match=message):
            build_dataset(_data_cfg(path).TRAIN)
    monkeypatch.setitem(sys.modules, "webdataset", None)  # as if not installed
    line = 'the webdataset data source needs the webdataset package: pip install "vistrain[webdataset]"'
    with pytest.raises(ConfigError, match=re.escape(line)):
        build_dataset(_data_cfg(shards).TRAIN)
    code, _, err = _make_shards(capsys, tmp_path, tmp_path / "out")
    assert code == 2 and err.splitlines() == [f"config error: {line}"]
