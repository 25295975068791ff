"""Label fractions (DATA.TRAIN.LABEL_FRACTION): the pure subset rule over many cases, and the
engines that use it (linear evaluation, kNN, fine-tuning) recording it; the subset stays inside
the TRAIN split of the digits and of ELPV's layout."""

import json
import math
from collections import Counter

import numpy as np
import pytest
import torch
from test_real_images import _elpv_folder

from vistrain.benchmarks import finetune, knn, label_fraction, linear_eval, lr_grid
from vistrain.benchmarks.label_fraction import BatchFit, fit_batch, label_subset
from vistrain.config import ConfigError
from vistrain.distributed.testing import run_on_ranks
from vistrain.jobs import check_values
from vistrain.methods import load_config

CPU = torch.device("cpu")


def _case(seed: int):
    """Random labelled indices: 1-12 classes of 1-40 images each, indices sparse and shuffled."""
    rng = np.random.default_rng(seed)
    counts = rng.integers(1, 41, size=rng.integers(1, 13))
    labels = np.repeat(np.arange(len(counts)), counts)
    indices = rng.choice(10 * len(labels), size=len(labels), replace=False)
    order = rng.permutation(len(labels))
    return indices[order].tolist(), labels[order].tolist()


def _expected(count: int, fraction: float) -> int:
    return min(count, max(1, math.floor(fraction * count + 0.5)))


@pytest.mark.parametrize("seed", range(40))
def test_label_subset_is_stratified_repeatable_nested_and_inside_the_split(seed):
    indices, labels = _case(seed)
    label_of = dict(zip(indices, labels))
    per_class = Counter(labels)
    previous = []
    for fraction in (0.01, 0.1, 0.25, 0.5, 1.0):
        subset = label_subset(indices, labels, fraction, seed=seed)
        assert subset == sorted(set(subset)) and set(subset) <= set(indices)  # disjoint from any other split
        kept = Counter(label_of[i] for i in subset)
        assert kept == {c: _expected(n, fraction) for c, n in per_class.items()}  # every class, at least 1
        assert set(previous) <= set(subset)  # a smaller fraction's images are among a larger one's
        previous = subset
        assert label_subset(indices, labels, fraction, seed=seed) == subset  # repeatable
        order = np.random.default_rng(seed + 1000).permutation(len(indices))
        shuffled = label_subset([indices[i] for i in order], [labels[i] for i in order], fraction, seed)
        assert shuffled == subset  # the listing order does not matter
    assert previous == sorted(indices)  # fraction 1: every labelled image


def test_label_subset_seeds_draw_different_images_and_rounds_half_up():
    indices, labels = list(range(200)), [i % 2 for i in range(200)]  # 100 per class
    draws = {tuple(label_subset(indices, labels, 0.1, seed)) for seed in range(5)}
    assert len(draws) == 5
    assert len(label_subset(list(range(5)), [0] * 5, 0.5, 0)) == 3  # 2.5 -> 3
    assert len(label_subset(list(range(3)), [0] * 3, 0.01, 0)) == 1  # never empty


@pytest.mark.parametrize(
    "args, message",
    [
        (([0, 1], [0, 1], 0.0, 0), "LABEL_FRACTION must be in"),
        (([0, 1], [0, 1], 1.5, 0), "LABEL_FRACTION must be in"),
        (([0, 1], [0, 1], 0.5, -1), "LABEL_SUBSET_SEED must be"),
        (([0, 1], [0, -1], 0.5, 0), "labelled images only"),
        (([0, 0], [0, 1], 0.5, 0), "one label per distinct index"),
    ],
)
def test_label_subset_refuses_bad_input(args, message):
    with pytest.raises(ValueError, match=message):
        label_subset(*args)


def test_label_fraction_outside_the_labelled_jobs_is_one_line():
    for job, key in (("train", "LABEL_FRACTION"), ("extract_features", "LABEL_FRACTION")):
        cfg = load_config(
            ["config=test/benchmark_tiny", f"config.JOB={job}", "config.DATA.TRAIN.LABEL_FRACTION=0.5"]
        )
        with pytest.raises(ConfigError, match=f"DATA.TRAIN.{key} is for the jobs that use labels"):
            check_values(cfg)
    with pytest.raises(ConfigError, match=r"DATA.TRAIN.LABEL_FRACTION must be <= 1"):
        check_values(load_config(["config=test/benchmark_tiny", "config.DATA.TRAIN.LABEL_FRACTION=2.0"]))


# --------------------------------------------------------------------------------------------
# batches and folds fitted to few labels


@pytest.mark.parametrize(
    "images, world, batch, fitted",
    [
        (14, 2, 64, 7),  # 1% of a digits-sized set on 2 ranks: one batch of 7 per rank
        (96, 2, 64, 48),  # a 3-fold fit part of the digits' 10%
        (145, 2, 64, 64),  # one global batch fits: as configured
        (128, 2, 64, 64),
        (127, 2, 64, 63),
        (10, 3, 4, 3),
        (5, 1, 8, 5),
        (1000, 8, 32, 32),
    ],
)
def test_fit_batch_keeps_the_batch_when_it_fits_else_takes_the_images_in_one_step(
    images, world, batch, fitted
):
    assert fit_batch(images, world, batch) == fitted


def test_fit_batch_over_many_sizes_and_world_sizes():
    for world in range(1, 9):
        for batch in (1, 3, 8, 64):
            for images in range(world, 300, 7):
                got = fit_batch(images, world, batch)
                assert 1 <= got <= batch and got * world <= images  # a full batch on every rank
                if images < world * batch:  # one iteration, fewer than `world` images left out
                    assert images - got * world < world
    with pytest.raises(ValueError, match="cannot fill a batch on each of 2 ranks"):
        fit_batch(1, 2, 64)


def test_batch_fit_says_once_which_passes_got_a_smaller_batch():
    fit = BatchFit(64, 2, drop_last=True)
    assert [
        fit.batch("the final fit", 145),
        fit.batch("the fit parts", 96),
        fit.batch("the fit parts", 97),
    ] == [
        64,
        48,
        48,
    ]
    assert fit.note().endswith(
        "batch per rank: the final fit (145 images) 64, the fit parts (96-97 images) 48"
    )
    assert BatchFit(64, 2, drop_last=False).batch("the final fit", 14) == 64  # padded: nothing to fit
    untouched = BatchFit(8, 2, drop_last=True)
    untouched.batch("the final fit", 40)
    assert untouched.note() is None
    with pytest.raises(ConfigError, match="the final fit of DATA.TRAIN: 1 image cannot fill"):
        BatchFit(8, 2, drop_last=True).batch("the final fit", 1)


def test_lr_splits_hold_out_only_classes_left_in_the_fit_part():
    """ELPV's 1% (classes of 11, 2, 1 and 5 images), 3 folds asked: 2 folds over the classes of 2+
    images, the single image in every fit part; the digits' 1% (one image per class): nothing to
    hold out; enough images: the 3 folds as asked."""
    labels = [0] * 11 + [1] * 2 + [2] + [3] * 5
    splits, note = lr_grid.lr_splits(labels, 3, 0.1, seed=0)
    assert len(splits) == 2 and "2-fold cross-validation (not 3: a class has only 2 images)" in note
    assert sorted(i for _, held_out in splits for i in held_out) == [i for i in range(19) if labels[i] != 2]
    for fit, held_out in splits:
        assert 13 in fit and not set(fit) & set(held_out)
        assert {labels[i] for i in held_out} <= {labels[i] for i in fit}
    splits, note = lr_grid.lr_splits(list(range(10)), 3, 0.1, seed=0)
    assert splits == [] and note.startswith("no class has two labelled images (10 images, one per class)")
    labels = [c for c in range(10) for _ in range(14)]
    splits, note = lr_grid.lr_splits(labels, 3, 0.1, seed=0)
    assert note is None and splits == lr_grid.stratified_folds(labels, 3, 0)
    assert lr_grid.lr_splits(labels, 1, 0.1, seed=0) == ([lr_grid.holdout_split(labels, 0.1, 0)], None)


# --------------------------------------------------------------------------------------------
# the engines


def _engine(rank, world_size, engine, argv):
    engine(load_config(argv))
    return rank


def _engines(rank, world_size, runs):
    for engine, argv in runs:
        engine(load_config(argv))
    return rank


def test_linear_eval_and_knn_train_on_the_subset_and_record_it(tmp_path):
    """48 synthetic images of 10 classes (4-5 each), half the labels: 28 images (classes of 5 keep
    3, of 4 keep 2), with the lr chosen by 2 folds of those 28 only. Then, in the same ranks, the
    cases that stopped before the batch was fitted to the labelled images: fit parts of 14 images
    under DROP_LAST with 2 ranks x 8, and fine-tuning on one image per class (10 images)."""
    fraction = ["config.DATA.TRAIN.SYNTHETIC_SIZE=48", "config.DATA.TRAIN.LABEL_FRACTION=0.5"]
    common = ["config=test/benchmark_tiny", *fraction, "config.DATA.TRAIN.LABEL_SUBSET_SEED=3"]
    linear = [
        *common,
        f"config.CHECKPOINT.DIR={tmp_path / 'linear'}",
        "config.BENCHMARK.LINEAR_LRS=[0.01,0.1]",
    ]
    run_on_ranks(_engine, 2, linear_eval, [*linear, "config.BENCHMARK.LINEAR_LR_FOLDS=2"])
    record = json.loads((tmp_path / "linear" / "metrics.json").read_text())
    assert (record["label_fraction"], record["label_subset_seed"], record["num_train_images"]) == (0.5, 3, 28)
    assert record["iterations"] == 2 * 2 + 4  # two folds fit 14 images (2 steps of 8), then 28 (4 steps)
    assert (
        "lr grid on 28 held-out training images (14 fit, 2-fold"
        in (tmp_path / "linear" / "log.txt").read_text()
    )
    fitted = [*linear, "config.BENCHMARK.LINEAR_LR_FOLDS=2", f"config.CHECKPOINT.DIR={tmp_path / 'fitted'}"]
    fitted += ["config.DATA.TRAIN.DROP_LAST=True", "config.DATA.TRAIN.BATCHSIZE_PER_REPLICA=8"]
    one_each = [
        "config=test/finetune_tiny",
        "config.DATA.TRAIN.SYNTHETIC_SIZE=48",
        "config.BENCHMARK.FINETUNE.LRS=[0.01,0.1]",
    ]
    one_each += ["config.DATA.TRAIN.LABEL_FRACTION=0.1", "config.DATA.TRAIN.BATCHSIZE_PER_REPLICA=8"]
    runs = [
        (knn, [*common, f"config.CHECKPOINT.DIR={tmp_path / 'knn'}", "config.JOB=knn"]),
        (linear_eval, fitted),
        (finetune, [*one_each, f"config.CHECKPOINT.DIR={tmp_path / 'finetune'}"]),
    ]
    run_on_ranks(_engines, 2, runs)
    record = json.loads((tmp_path / "fitted" / "metrics.json").read_text())
    assert record["iterations"] == 2 + 1  # each fold: 14 images in one batch of 7 per rank; then 28: 1 x 16
    assert (
        "batch per rank: the final fit (28 images) 8, the fit parts (14 images) 7"
        in (tmp_path / "fitted" / "log.txt").read_text()
    )
    record = json.loads((tmp_path / "finetune" / "metrics.json").read_text())
    assert record["num_train_images"] == 10 and record["selection"] is None and record["lr"] == 0.05
    assert record["iterations"] == 1  # 10 images: one batch of 5 per rank, OPTIMIZER's one epoch
    assert (
        "no class has two labelled images (10 images, one per class)"
        in (tmp_path / "finetune" / "log.txt").read_text()
    )
    record = json.loads((tmp_path / "knn" / "metrics.json").read_text())
    assert record["num_train_images"] == 28 and record["label_fraction"] == 0.5
    assert {r["bank_size"] for r in record["results"].values()} == {28}


def _train_and_test_items(cfg):
    """(training images the evaluation uses, every TEST image), as (source, item) keys."""
    from vistrain.data import build_loader

    loader, subset = label_fraction.labelled_train_loader(cfg, CPU)
    test = build_loader(cfg.DATA, "TEST", seed=0, device=CPU).dataset
    train = loader.dataset
    assert subset is not None and train.indices == subset
    return [train.dataset.sources[0].paths[i] for i in subset], set(test.sources[0].paths)


def test_digit_fractions_are_drawn_from_the_train_split_only(tmp_path):
    cfg = load_config(
        [
            "config=benchmark/linear_eval_regnet",
            f"config.DATA.CACHE_DIR={tmp_path}",
            "config.DATA.TRAIN.LABEL_FRACTION=0.1",
            "config.DATA.TRAIN.BATCHSIZE_PER_REPLICA=4",  # the 1% below: 10 digits
        ]
    )
    chosen, test = _train_and_test_items(cfg)
    assert not set(chosen) & test
    from vistrain.data import build_dataset

    per_class = Counter(build_dataset(cfg.DATA.TRAIN, cfg.DATA.CACHE_DIR).targets)
    assert len(chosen) == sum(_expected(n, 0.1) for n in per_class.values()) == 145  # 14-15 of each digit
    cfg.defrost()
    cfg.DATA.TRAIN.LABEL_FRACTION = 0.01
    smaller, _ = _train_and_test_items(cfg)
    assert len(smaller) == 10 and set(smaller) <= set(chosen)  # one per digit, among the 10%'s


def test_elpv_fractions_are_drawn_from_the_train_side_only(tmp_path):
    folder = _elpv_folder(tmp_path / "elpv")
    overrides = [f"config.DATA.{split}.DATA_PATHS=[{folder}]" for split in ("TRAIN", "TEST")]
    cfg = load_config(
        [
            "config=benchmark/linear_eval_elpv",
            *overrides,
            "config.DATA.TRAIN.LABEL_FRACTION=0.25",
            "config.DATA.TRAIN.BATCHSIZE_PER_REPLICA=4",
        ]
    )
    chosen, test = _train_and_test_items(cfg)
    assert not set(chosen) & test
    from vistrain.data.elpv import ElpvSource

    train = ElpvSource(str(folder), "train", split_seed=0)
    per_class = Counter(train.labels)
    kept = Counter(train.labels[train.paths.index(path)] for path in chosen)
    assert kept == {c: _expected(n, 0.25) for c, n in per_class.items()}
