"""Real images: unlabelled folders for pretraining, the ELPV source and its split."""

import importlib.util
import json
import os
import re
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from vistrain.benchmarks import common
from vistrain.config import ConfigError, DataError
from vistrain.data import build_dataset, build_loader
from vistrain.data.datasets import count_samples
from vistrain.data.elpv import ElpvSource, package_folder, read_labels, split_side, stratified_split
from vistrain.data.loader import auto_workers
from vistrain.distributed.testing import run_on_ranks
from vistrain.methods import get_defaults, load_config
from vistrain.training.trainer import train

CPU = torch.device("cpu")
HAS_ELPV = importlib.util.find_spec("elpv_dataset") is not None


def _png(path, value, side=20, mode="RGB"):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    colour = value if mode == "L" else (value, 255 - value, value // 2)
    Image.new(mode, (side, side), colour).save(path)


def _split_cfg(path, **overrides):
    cfg = get_defaults().DATA
    cfg.TRAIN.DATA_SOURCES, cfg.TRAIN.DATA_PATHS = ["disk_folder"], [str(path)]
    for key, value in overrides.items():
        cfg.TRAIN[key] = value
    return cfg


# --------------------------------------------------------------------------------------------
# unlabelled folders


def test_a_flat_folder_is_read_unlabelled(tmp_path):
    for i in range(5):
        _png(str(tmp_path / f"{i}.png"), 40 * i)
    (tmp_path / "notes.txt").write_text("not an image")
    cfg = _split_cfg(tmp_path)
    dataset = build_dataset(cfg.TRAIN)
    assert len(dataset) == 5 == count_samples(cfg.TRAIN) and dataset.targets == [-1] * 5
    assert dataset[(2, 0)]["label"] == -1


def test_a_nested_folder_without_classes_is_read_whole_when_asked(tmp_path):
    for folder in ("2023", "2024/may"):
        for i in range(2):
            _png(str(tmp_path / folder / f"{i}.jpg"), 30 * i)
    (tmp_path / "2024" / "loop").symlink_to("..")  # walked once
    auto = build_dataset(_split_cfg(tmp_path).TRAIN)  # subfolders and no image at the top: classes
    assert auto.targets == [0, 0, 1, 1]
    unlabelled = build_dataset(_split_cfg(tmp_path, FOLDER_LABELS="none").TRAIN)
    assert unlabelled.targets == [-1] * 4
    assert [os.path.relpath(p, tmp_path) for p in unlabelled.sources[0].paths] == [
        "2023/0.jpg", "2023/1.jpg", "2024/may/0.jpg", "2024/may/1.jpg",
    ]  # fmt: skip


def test_an_empty_flat_folder_and_classes_asked_of_a_flat_folder_are_one_line(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match="no images"):
        build_dataset(_split_cfg(tmp_path / "empty", FOLDER_LABELS="none").TRAIN)
    _png(str(tmp_path / "flat" / "a.png"), 9)
    with pytest.raises(DataError, match="no class subfolders .*FOLDER_LABELS=none"):
        build_dataset(_split_cfg(tmp_path / "flat", FOLDER_LABELS="subfolders").TRAIN)


def test_evaluation_of_an_unlabelled_folder_says_how_to_label_it(tmp_path):
    for i in range(4):
        _png(str(tmp_path / f"{i}.png"), 40 * i)
    dataset = build_dataset(_split_cfg(tmp_path).TRAIN)
    with pytest.raises(
        DataError, match=r"4 of 4 images without a label: evaluation needs labels; .*class subfolders"
    ):
        common.check_labels(dataset, "TRAIN")


def _train_on_rank(rank, world_size, argv):
    train(load_config(argv))
    return rank


def test_a_flat_folder_pretrains(tmp_path):
    rng = np.random.default_rng(0)
    (tmp_path / "photos").mkdir()
    for i in range(16):  # 16 images: 2 iterations of 2 ranks x 4
        pixels = rng.integers(0, 255, (20, 20, 3), dtype=np.uint8)
        Image.fromarray(pixels).save(tmp_path / "photos" / f"{i}.png")
    argv = [
        "config=test/simclr_tiny",
        f"config.CHECKPOINT.DIR={tmp_path / 'run'}",
        "config.DATA.TRAIN.DATA_SOURCES=[disk_folder]",
        f"config.DATA.TRAIN.DATA_PATHS=[{tmp_path / 'photos'}]",
        "config.OPTIMIZER.num_epochs=1",
    ]
    run_on_ranks(_train_on_rank, 2, argv)
    lines = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert lines[-1]["iteration"] == 2 and np.isfinite(lines[-1]["loss"])
    # the step's wait for data, apart from compute: in the log line, metrics.jsonl and TensorBoard
    assert all(0 <= r["data_share"] <= 1 and r["data_time"] >= 0 for r in lines)
    assert re.search(r"img/s  data \d+\.\d{3}s \(\d+%\)  eta", (tmp_path / "run" / "log.txt").read_text())
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tmp_path / "run" / "tb")).Reload()
    assert "train/data_share" in events.Tags()["scalars"]


@pytest.mark.parametrize(
    "cores, ranks, threads, cuda, workers",
    [
        (2, 2, 1, False, 0),  # this box: both cores compute
        (16, 2, 8, False, 0),  # the launcher's default threads fill the cores
        (16, 2, 2, False, 6),  # OMP_NUM_THREADS=2: 12 spare cores, 6 per rank
        (64, 1, 4, False, 8),  # capped
        (16, 8, 1, True, 1),  # one GPU per rank: a core stays with each rank
        (96, 8, 1, True, 8),
        (2, 4, 1, True, 1),
    ],
)
def test_loader_workers_are_chosen_for_the_machine(cores, ranks, threads, cuda, workers):
    assert auto_workers(cores, ranks, threads, cuda) == workers


# --------------------------------------------------------------------------------------------
# ELPV


def _elpv_folder(root: Path, per_stratum=None) -> Path:
    """A folder of the package's layout: images/cellNNNN.png + labels.csv (path, probability, type)."""
    per_stratum = per_stratum or {(0, "mono"): 12, (1, "mono"): 5, (2, "mono"): 3, (3, "mono"): 6,
                                  (0, "poly"): 14, (1, "poly"): 4, (2, "poly"): 2, (3, "poly"): 7}  # fmt: skip
    lines, n = [], 0
    for (label, kind), count in per_stratum.items():
        for _ in range(count):
            n += 1
            name = f"images/cell{n:04d}.png"
            _png(str(root / name), 60 * label + (3 if kind == "poly" else 0), side=30, mode="L")
            lines.append(f"{name}  {label / 3:.16f}  {kind}")
    order = np.random.default_rng(1).permutation(len(lines))  # the real file goes module by module
    (root / "labels.csv").write_text("\n".join(lines[i] for i in order) + "\n")
    return root


def _elpv_strata():
    """(class, type) of each of ELPV's 2,624 cells, in the real counts."""
    classes = [0] * 1508 + [1] * 295 + [2] * 106 + [3] * 715
    kinds = (["mono"] * 588 + ["poly"] * 920) + (["mono"] * 117 + ["poly"] * 178)
    kinds += (["mono"] * 56 + ["poly"] * 50) + (["mono"] * 313 + ["poly"] * 402)
    return list(zip(classes, kinds))


def test_split_is_stratified_disjoint_repeatable_and_75_25():
    strata = _elpv_strata()
    train, test = stratified_split(strata, seed=3)
    assert (len(train), len(test)) == (1968, 656)  # the paper's sizes
    assert sorted(train + test) == list(range(2624)) and not set(train) & set(test)
    assert (train, test) == stratified_split(strata, seed=3)
    assert test != stratified_split(strata, seed=4)[1]
    everywhere, in_test = Counter(strata), Counter(strata[i] for i in test)
    for stratum, count in everywhere.items():
        assert abs(in_test[stratum] - 0.25 * count) < 1, stratum


def test_recipe_choosing_sides_split_the_train_side_only():
    strata = _elpv_strata()
    train, test = stratified_split(strata, seed=3)
    fit, select = (split_side(strata, side, seed=3) for side in ("train_fit", "train_select"))
    assert (split_side(strata, "train", 3), split_side(strata, "val", 3)) == (train, test)
    assert (len(fit), len(select)) == (1476, 492)
    assert sorted(fit + select) == train and not set(fit) & set(select)
    assert select == split_side(strata, "train_select", seed=3) != split_side(strata, "train_select", 4)
    in_train, in_select = Counter(strata[i] for i in train), Counter(strata[i] for i in select)
    for stratum, count in in_train.items():
        assert abs(in_select[stratum] - 0.25 * count) < 1, stratum
    with pytest.raises(ConfigError, match=r"SPLIT 'test' is not one of train .* train_select"):
        split_side(strata, "test", 3)


def test_elpv_source_on_a_folder_of_the_package_layout(tmp_path):
    folder = _elpv_folder(tmp_path / "elpv")
    paths, classes, types = read_labels(str(folder))
    assert (
        len(paths) == 53 and set(classes.tolist()) == {0, 1, 2, 3} and set(types.tolist()) == {"mono", "poly"}
    )
    train = ElpvSource(str(folder), "train", split_seed=0, decode_size=16)
    test = ElpvSource(str(folder), "val", split_seed=0, decode_size=16)
    assert len(train) + len(test) == 53 and len(test) == 13
    assert not set(train.paths) & set(test.paths)
    image, label = train.load(0)
    assert image.dtype == np.uint8 and image.shape == (16, 16) and label == train.labels[0]  # grayscale
    assert abs(int(image[0, 0]) - 60 * label) <= 3  # the label's shade
    os.remove(train.paths[0])
    assert train.load(0)[1] == label  # decoded once: kept in memory
    fit, select = (ElpvSource(str(folder), side, split_seed=0) for side in ("train_fit", "train_select"))
    assert sorted(fit.paths + select.paths) == sorted(train.paths) and len(select) == 10
    with pytest.raises(ConfigError, match=r"SPLIT 'tests' is not one of"):
        ElpvSource(str(folder / "missing"), "tests", split_seed=0)  # named before any file is read


def test_elpv_through_the_config(tmp_path):
    folder = _elpv_folder(tmp_path / "elpv")
    cfg = get_defaults().DATA
    for split, side in (("TRAIN", "train"), ("TEST", "val")):
        cfg[split].DATA_SOURCES, cfg[split].DATA_PATHS, cfg[split].SPLIT = ["elpv"], [str(folder)], side
        cfg[split].DECODE_SIZE = 16
    cfg.SPLIT_SEED = 5
    train, test = (build_loader(cfg, s, seed=0, device=CPU).dataset for s in ("TRAIN", "TEST"))
    assert (len(train), len(test)) == (40, 13) == (count_samples(cfg.TRAIN), count_samples(cfg.TEST))
    assert not set(train.sources[0].paths) & set(test.sources[0].paths)
    assert common.num_classes(train, test) == 4
    views = train.views((0, 0))  # made on one channel, handed to the trunk as three
    mean, std = (
        torch.tensor(v)[:, None, None] for v in (cfg.TRAIN.TRANSFORMS.MEAN, cfg.TRAIN.TRANSFORMS.STD)
    )
    pixels = views[0] * std + mean
    assert len(views) == 2 and views[0].shape == (3, 32, 32)
    torch.testing.assert_close(pixels[0], pixels[2])
    cfg.TRAIN.SPLIT = "test"
    with pytest.raises(ConfigError, match="SPLIT 'test'"):
        build_dataset(cfg.TRAIN)


@pytest.mark.skipif(not HAS_ELPV, reason="elpv-dataset is not installed (pip install -e '.[elpv]')")
def test_elpv_package_is_read_where_it_is_installed():
    folder = package_folder()
    train = ElpvSource(folder, "train", split_seed=0)
    test = ElpvSource(folder, "val", split_seed=0)
    assert (len(train), len(test)) == (1968, 656)
    assert Counter(train.labels + test.labels) == {0: 1508, 1: 295, 2: 106, 3: 715}
    image, _ = test.load(0)
    assert image.shape == (300, 300)


# --------------------------------------------------------------------------------------------
# the shipped ELPV recipes, shrunk, on a generated folder: they run, and draw their pictures


def _linear_eval_on_rank(rank, world_size, argv):
    from vistrain.benchmarks.linear_eval import linear_eval

    linear_eval(load_config(argv))
    return rank


def _shrunk_elpv(folder, run_dir, *overrides):
    small = [
        f"config.DATA.{split}.{key}" for split in ("TRAIN", "TEST") for key in ("DATA_PATHS", "DECODE_SIZE")
    ]
    return [
        f"config.CHECKPOINT.DIR={run_dir}",
        f"{small[0]}=[{folder}]", f"{small[1]}=32", f"{small[2]}=[{folder}]", f"{small[3]}=32",
        "config.DATA.TRAIN.BATCHSIZE_PER_REPLICA=8",
        "config.DATA.TEST.BATCHSIZE_PER_REPLICA=8",
        "config.DATA.TEST.TRANSFORMS.RESIZE=32",
        "config.DATA.TEST.TRANSFORMS.CENTER_CROP=32",
        "config.DATA.NUM_DATALOADER_WORKERS=0",
        "config.OPTIMIZER.num_epochs=2",
        "config.LOG_FREQUENCY=1",
        *overrides,
    ]  # fmt: skip


def test_elpv_recipes_pretrain_then_evaluate_and_draw(tmp_path):
    folder = _elpv_folder(tmp_path / "elpv")
    pretrain = _shrunk_elpv(folder, tmp_path / "pretrain", "config.DATA.TRAIN.TRANSFORMS.SIZE_CROPS=[32,16]")
    run_on_ranks(_train_on_rank, 2, ["config=pretrain/simclr_regnet_elpv", *pretrain])
    assert (tmp_path / "pretrain" / "views.png").stat().st_size > 0
    with Image.open(tmp_path / "pretrain" / "views.png") as views:  # 8 rows of 6 views (2 + 4 small)
        assert views.size[1] > views.size[0] > 0
    evaluate = _shrunk_elpv(
        folder,
        tmp_path / "eval",
        "config.DATA.TRAIN.TRANSFORMS.RESIZE=32",
        "config.DATA.TRAIN.TRANSFORMS.CENTER_CROP=32",
        "config.BENCHMARK.LINEAR_LR_FOLDS=2",
        f"config.MODEL.WEIGHTS_INIT.PARAMS_FILE={tmp_path / 'pretrain'}",
    )
    run_on_ranks(_linear_eval_on_rank, 2, ["config=benchmark/linear_eval_elpv", *evaluate])
    record = json.loads((tmp_path / "eval" / "metrics.json").read_text())
    picked = record["picked"]
    assert picked["feature"] in record["results"] and picked["num_images"] == 13
    assert {"top1", "top1_2class", "holdout_top1"} <= set(picked)
    for name in ("confusion.png", "neighbours.png"):
        with Image.open(tmp_path / "eval" / name) as picture:
            assert min(picture.size) > 50
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    images = EventAccumulator(str(tmp_path / "eval" / "tb")).Reload().Tags()["images"]
    assert {"linear_eval/confusion", "linear_eval/neighbours"} <= set(images)
