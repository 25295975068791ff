"""Benchmarks: linear evaluation, kNN and feature extraction of a frozen trunk.

Multi-rank paths run on real gloo processes (``run_on_ranks``) and are compared with one process;
one test goes through ``tools/run_distributed.py`` as a user would. All on the tiny recipe
configs/test/benchmark_tiny.yaml (a 2-stage RegNet on 16px synthetic images).
"""

import json
import math
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from PIL import Image

from vistrain.benchmarks import (
    LinearHeads,
    common,
    extract_features,
    knn_class_scores,
    knn_topk_hits,
    linear_eval,
    lr_grid,
)
from vistrain.benchmarks.knn import build_bank, knn_counts
from vistrain.benchmarks.linear_eval import FrozenFeatures, cache_features, train_heads
from vistrain.checkpoint import CheckpointError
from vistrain.config import ConfigError
from vistrain.data import build_loader, rank_indices
from vistrain.distributed.testing import run_on_ranks
from vistrain.jobs import check_values
from vistrain.methods import build_model, load_config

REPO = Path(__file__).resolve().parents[1]
CPU = torch.device("cpu")


def _tiny(run_dir, *overrides):
    return ["config=test/benchmark_tiny", f"config.CHECKPOINT.DIR={run_dir}", *overrides]


def _save_pretrained(path, *overrides, randomise_bn=True):
    """A consolidated checkpoint of a tiny SimCLR model (trunk + head), with non-trivial BN buffers."""
    cfg = load_config(["config=test/simclr_tiny", *overrides])
    torch.manual_seed(1)
    model = build_model(cfg.MODEL)
    state = model.state_dict()
    if randomise_bn:
        for key, value in state.items():
            if key.endswith(("running_mean", "running_var")):
                value.copy_(torch.rand_like(value) + 0.5)
    torch.save(state, path)
    return state


# --------------------------------------------------------------------------------------------
# linear evaluation


@pytest.mark.parametrize("pool_size", [1, 2])
def test_linear_heads_see_pooled_features_of_each_requested_stage(pool_size):
    cfg = load_config(
        _tiny(
            "unused",
            "config.MODEL.FSDP_CONFIG.AUTO_SETUP_FSDP=False",
            "config.BENCHMARK.FEATURES=[stem, s1, s2, avgpool]",
            f"config.BENCHMARK.POOL_SIZE={pool_size}",
        )
    )
    trunk, dims = common.build_frozen_trunk(cfg, CPU)
    p2 = pool_size**2
    assert dims == {"stem": 8 * p2, "s1": 8 * p2, "s2": 16 * p2, "avgpool": 16}  # widths 8 (stem), 8, 16
    images = torch.randn(3, 3, 16, 16)
    features = common.trunk_features(trunk, images, list(dims), pool_size)
    maps = trunk(images)  # stem 8x8, s1 4x4, s2 2x2 maps; avgpool (3, 16)
    for name in ("stem", "s1", "s2"):
        side = maps[name].shape[-1]
        expected = F.avg_pool2d(maps[name], side // pool_size).flatten(1)
        torch.testing.assert_close(features[name], expected)
    torch.testing.assert_close(features["avgpool"], maps["s2"].mean(dim=(2, 3)))

    heads = LinearHeads(dims, num_classes=10)
    seen = {}
    for name, head in heads.heads.items():
        head.register_forward_pre_hook(
            lambda mod, args, name=name: seen.__setitem__(name, tuple(args[0].shape))
        )
    logits = heads(features)
    assert seen == {name: (3, dim) for name, dim in dims.items()}
    assert {name: tuple(t.shape) for name, t in logits.items()} == dict.fromkeys(dims, (3, 10))


def test_a_feature_joined_by_plus_is_its_parts_pooled_and_concatenated():
    """BENCHMARK.FEATURES entry "s1+s2+avgpool": the pooled parts side by side, in that order,
    one head over the whole width; the trunk is asked for each part once."""
    cfg = load_config(
        _tiny(
            "unused",
            "config.MODEL.FSDP_CONFIG.AUTO_SETUP_FSDP=False",
            "config.BENCHMARK.FEATURES=[s2, s1+s2+avgpool]",
            "config.BENCHMARK.POOL_SIZE=2",
        )
    )
    assert common.trunk_model_config(cfg).TRUNK.OUT_FEATURES == ["s2", "s1", "avgpool"]
    trunk, dims = common.build_frozen_trunk(cfg, CPU)
    assert dims == {"s2": 16 * 4, "s1+s2+avgpool": 8 * 4 + 16 * 4 + 16}
    images = torch.randn(3, 3, 16, 16)
    features = common.trunk_features(trunk, images, list(dims), 2)
    maps = trunk(images)
    parts = [F.adaptive_avg_pool2d(maps["s1"], 2).flatten(1), F.adaptive_avg_pool2d(maps["s2"], 2).flatten(1)]
    torch.testing.assert_close(features["s1+s2+avgpool"], torch.cat([*parts, maps["avgpool"]], dim=1))
    torch.testing.assert_close(features["s2"], parts[1])
    logits = LinearHeads(dims, num_classes=10)(features)
    assert logits["s1+s2+avgpool"].shape == (3, 10)


def _symmetries(images):
    """The 8 symmetries of the square applied to (N, C, H, W), written with transposes and flips."""
    transpose = images.transpose(2, 3)
    return [
        images, images.flip(3), images.flip(2), images.flip(2).flip(3),
        transpose, transpose.flip(3), transpose.flip(2), transpose.flip(2).flip(3),
    ]  # fmt: skip


def test_dihedral_feature_views_average_the_eight_symmetries_and_do_not_see_them():
    """FEATURE_VIEWS dihedral: f(x) = mean of the pooled features of x's 8 turns and mirrors, so a
    turned or mirrored image has the same features; "flip" averages x and its left-right mirror."""
    cfg = load_config(
        _tiny(
            "unused",
            "config.MODEL.FSDP_CONFIG.AUTO_SETUP_FSDP=False",
            "config.BENCHMARK.FEATURES=[s1, s1+s2]",
        )
    )
    trunk, dims = common.build_frozen_trunk(cfg, CPU)
    images, names = torch.randn(3, 3, 16, 16), list(dims)
    averaged = common.trunk_features(trunk, images, names, 2, views="dihedral")
    by_hand = [common.trunk_features(trunk, view, names, 2) for view in _symmetries(images)]
    for name in names:
        torch.testing.assert_close(averaged[name], torch.stack([f[name] for f in by_hand]).mean(0))
        assert not torch.allclose(averaged[name], by_hand[0][name], atol=1e-3)  # the views differ
    for view in _symmetries(images)[1:]:
        turned = common.trunk_features(trunk, view, names, 2, views="dihedral")
        for name in names:
            torch.testing.assert_close(turned[name], averaged[name], rtol=1e-5, atol=1e-5)
    flipped = common.trunk_features(trunk, images, names, 2, views="flip")
    mirror = common.trunk_features(trunk, images.flip(3), names, 2)
    torch.testing.assert_close(flipped["s1"], (by_hand[0]["s1"] + mirror["s1"]) / 2)


def test_an_unknown_feature_view_is_refused_in_one_line():
    cfg = load_config(_tiny("unused", "config.BENCHMARK.FEATURE_VIEWS=rotations"))
    with pytest.raises(
        ConfigError, match="BENCHMARK.FEATURE_VIEWS must be one of dihedral, flip, identity; got 'rotations'"
    ):
        check_values(cfg)


def test_a_feature_part_at_p_is_pooled_to_its_own_side():
    """ "s1@4+s2" with POOL_SIZE 1: s1 pooled to 4 x 4 (its whole map), s2 to 1 x 1, concatenated."""
    cfg = load_config(
        _tiny(
            "unused",
            "config.MODEL.FSDP_CONFIG.AUTO_SETUP_FSDP=False",
            "config.BENCHMARK.FEATURES=[s2, s1@4+s2]",
            "config.BENCHMARK.POOL_SIZE=1",
        )
    )
    assert common.trunk_model_config(cfg).TRUNK.OUT_FEATURES == ["s2", "s1"]
    trunk, dims = common.build_frozen_trunk(cfg, CPU)
    assert dims == {"s2": 16, "s1@4+s2": 8 * 16 + 16}
    images = torch.randn(3, 3, 16, 16)
    features = common.trunk_features(trunk, images, list(dims), 1)
    maps = trunk(images)  # s1 4x4, s2 2x2
    expected = torch.cat([maps["s1"].flatten(1), maps["s2"].mean(dim=(2, 3))], dim=1)
    torch.testing.assert_close(features["s1@4+s2"], expected)
    assert LinearHeads(dims, num_classes=10)(features)["s1@4+s2"].shape == (3, 10)


def _linear_eval_watching_the_trunk(rank, world_size, argv):
    """Run the engine; return the trunk's weights and buffers after it, and its modes."""
    seen = {}
    build = common.build_frozen_trunk

    def keep(cfg, device):
        trunk, dims = build(cfg, device)
        seen["trunk"] = trunk
        return trunk, dims

    common.build_frozen_trunk = keep  # this process only (forked test worker)
    try:
        linear_eval(load_config(argv))
    finally:
        common.build_frozen_trunk = build
    trunk = seen["trunk"]
    return {
        "state": trunk.state_dict(),  # collective for the sharded trunk: full weights and buffers
        "training": [m.training for m in trunk.modules()],
        "requires_grad": [p.requires_grad for p in trunk.parameters()],
    }


def test_trunk_stays_frozen_through_an_epoch_of_linear_eval(tmp_path):
    """Sharded trunk on 2 ranks: weights AND BatchNorm buffers are exactly the pretrained ones afterwards."""
    pretrained = _save_pretrained(tmp_path / "pretrained.pt")
    argv = _tiny(
        tmp_path / "run",
        f"config.MODEL.WEIGHTS_INIT.PARAMS_FILE={tmp_path / 'pretrained.pt'}",
        "config.MODEL.WEIGHTS_INIT.SKIP_LAYERS=[head.]",
    )
    results = run_on_ranks(_linear_eval_watching_the_trunk, 2, argv)
    trunk_keys = [k for k in pretrained if k.startswith("trunk.")]
    assert any(k.endswith("running_var") for k in trunk_keys)
    for result in results:
        assert sorted(result["state"]) == sorted(trunk_keys)
        for key in trunk_keys:
            torch.testing.assert_close(result["state"][key], pretrained[key], rtol=0, atol=0, msg=key)
        assert not any(result["training"]) and not any(result["requires_grad"])
    lines = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    assert json.loads(lines[-1])["iteration"] == 4  # 32 images / (2 ranks x 4): the heads did train


def _launch_linear_eval(argv):
    """``tools/run_distributed.py`` with ``argv`` in a subprocess; fails the test unless it exits 0."""
    proc = subprocess.run(
        [sys.executable, str(REPO / "tools" / "run_distributed.py"), *argv],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def test_linear_eval_through_the_launcher_writes_metrics(tmp_path):
    run_dir = tmp_path / "run"
    proc = _launch_linear_eval(_tiny(run_dir))
    metrics = json.loads((run_dir / "metrics.json").read_text())
    assert metrics["engine"] == "linear_eval" and metrics["world_size"] == 2 and metrics["num_classes"] == 10
    assert list(metrics["results"]) == ["s1", "s2", "avgpool"]
    for result in metrics["results"].values():
        assert result["num_images"] == 21  # 22 padded samples over 2 ranks, each image counted once
        assert 0 <= result["top1"] <= result["top5"] <= 100
        assert math.isclose(result["top1"] * 21 / 100, round(result["top1"] * 21 / 100), abs_tol=1e-6)
    assert [metrics["results"][n]["dim"] for n in ("s1", "s2", "avgpool")] == [32, 64, 16]
    table = [line.split("vistrain] ", 1)[1] for line in proc.stdout.splitlines() if "vistrain] " in line]
    start = table.index("linear evaluation on DATA.TEST (random init, 21 images):")
    assert table[start + 1].split() == ["feature", "dim", "top-1", "top-5"]
    assert [row.split()[:2] for row in table[start + 2 : start + 5]] == [
        ["s1", "32"],
        ["s2", "64"],
        ["avgpool", "16"],
    ]
    assert list((run_dir / "tb").glob("events.out.tfevents.*"))
    heads = torch.load(run_dir / "linear_heads.pt", weights_only=True)
    assert heads["heads.s2.1.weight"].shape == (10, 64)


def test_linear_eval_heads_are_the_same_on_any_world_size_without_trunk_sync_bn(tmp_path):
    """The probe heads' BatchNorm standardises over the global batch even when the trunk's
    config has no sync BN: 2 ranks x 4 images train the heads 1 rank x 8 images does."""
    heads = {}
    for world in (1, 2):
        argv = _tiny(
            tmp_path / str(world),
            "config.MODEL.SYNC_BN_CONFIG.CONVERT_BN_TO_SYNC_BN=False",
            f"config.DATA.TRAIN.BATCHSIZE_PER_REPLICA={8 // world}",
            "config.OPTIMIZER.num_epochs=2",
        )
        run_on_ranks(_engine_on_ranks, world, linear_eval, argv)
        heads[world] = torch.load(tmp_path / str(world) / "linear_heads.pt", weights_only=True)
    assert sorted(heads[2]) == sorted(heads[1])
    for key, value in heads[1].items():
        if value.is_floating_point():
            torch.testing.assert_close(heads[2][key], value, rtol=1e-5, atol=1e-6, msg=key)


def test_linear_eval_takes_one_view_per_image(tmp_path):
    cfg = load_config(_tiny(tmp_path, "config.DATA.TRAIN.TRANSFORMS.NAME=multicrop"))  # 2 crops (simclr_tiny)
    with pytest.raises(ConfigError, match=r"one view per image.*NUM_CROPS=\[1\]"):  # before launch
        check_values(cfg)


# --------------------------------------------------------------------------------------------
# kNN maths


def test_knn_weighted_vote_on_known_neighbours():
    bank = torch.tensor([[1.0, 0.0], [0.0, 1.0], [-1.0, 0.0], [0.8, 0.6]])
    labels = torch.tensor([0, 1, 2, 1])
    queries = torch.tensor([[1.0, 0.0], [0.0, 1.0]])
    t = 0.5
    scores = knn_class_scores(queries, bank, labels, num_classes=3, k=2, temperature=t)
    # query 0: neighbours 0 (sim 1.0, class 0) and 3 (sim 0.8, class 1)
    # query 1: neighbours 1 (sim 1.0, class 1) and 3 (sim 0.6, class 1)
    e = math.exp
    expected = torch.tensor([[e(1.0 / t), e(0.8 / t), 0.0], [0.0, e(1.0 / t) + e(0.6 / t), 0.0]])
    torch.testing.assert_close(scores, expected)
    hits = knn_topk_hits(
        queries, torch.tensor([0, 1]), bank, labels, 3, k=2, temperature=t, chunk_size=1, ks=(1,)
    )
    assert hits[:, 0].tolist() == [True, True]


def test_knn_vote_is_weighted_not_a_majority():
    # two far neighbours of class 1 against one very close neighbour of class 0
    bank = F.normalize(torch.tensor([[1.0, 0.05], [0.2, 1.0], [-0.2, 1.0]]), dim=1)
    labels = torch.tensor([0, 1, 1])
    query = torch.tensor([[1.0, 0.0]])
    weighted = knn_class_scores(query, bank, labels, 2, k=3, temperature=0.07)
    assert weighted.argmax(1).item() == 0
    flat = knn_class_scores(query, bank, labels, 2, k=3, temperature=1e6)  # ~equal weights: majority wins
    assert flat.argmax(1).item() == 1


def test_knn_chunks_and_large_k_change_nothing():
    torch.manual_seed(0)
    bank, queries = F.normalize(torch.randn(30, 8), dim=1), F.normalize(torch.randn(17, 8), dim=1)
    labels, query_labels = torch.randint(0, 6, (30,)), torch.randint(0, 6, (17,))
    whole = knn_topk_hits(queries, query_labels, bank, labels, 6, k=7, temperature=0.1, chunk_size=100)
    for chunk in (1, 4, 16):
        assert torch.equal(knn_topk_hits(queries, query_labels, bank, labels, 6, 7, 0.1, chunk), whole)
    capped = knn_class_scores(
        queries, bank, labels, 6, k=1000, temperature=0.1
    )  # k > N: every bank entry votes
    torch.testing.assert_close(capped.sum(1), (queries @ bank.T / 0.1).exp().sum(1))


def _toy_split(seed, n, dim=8, classes=5):
    g = torch.Generator().manual_seed(seed)
    return F.normalize(torch.randn(n, dim, generator=g), dim=1), torch.randint(0, classes, (n,), generator=g)


def _knn_on_ranks(rank, world_size):
    """Each rank holds the sampler's (padded) share of a 23-image bank and 10 test images."""
    train_x, train_y = _toy_split(0, 23)
    test_x, test_y = _toy_split(1, 10)
    mine = {}
    for split, n in (("train", 23), ("test", 10)):
        order = rank_indices(n, world_size, rank, 4, seed=0, epoch=0, shuffle=False, drop_last=False)
        mine[split] = torch.tensor(order)
    bank, bank_labels = build_bank(train_x[mine["train"]], train_y[mine["train"]], mine["train"])
    t = mine["test"]
    hits = knn_topk_hits(test_x[t], test_y[t], bank, bank_labels, 5, k=4, temperature=0.1, chunk_size=3)
    counts = knn_counts(hits, t)
    return {"counts": counts, "bank": bank, "bank_labels": bank_labels}


@pytest.mark.parametrize("world_size", [2, 3])
def test_multi_rank_knn_equals_single_rank(world_size):
    [single] = run_on_ranks(_knn_on_ranks, 1)
    train_x, train_y = _toy_split(0, 23)
    torch.testing.assert_close(single["bank"], train_x)  # one process: the whole set, in index order
    many = run_on_ranks(_knn_on_ranks, world_size)  # 23 and 10 don't divide: padded repeats
    for result in many:
        assert torch.equal(result["bank"], single["bank"]) and torch.equal(result["bank_labels"], train_y)
        assert result["counts"].tolist() == single["counts"].tolist()
    assert single["counts"][2].item() == 10


# --------------------------------------------------------------------------------------------
# feature extraction and kNN engines


def _engine_on_ranks(rank, world_size, engine, argv):
    engine(load_config(argv))
    return rank


def test_extract_features_merged_file_is_the_same_on_any_world_size(tmp_path):
    for world in (1, 2):
        argv = _tiny(tmp_path / str(world), "config.JOB=extract_features")
        run_on_ranks(_engine_on_ranks, world, extract_features, argv)
    one = torch.load(tmp_path / "1" / "features" / "test.pt", weights_only=True)
    two = torch.load(tmp_path / "2" / "features" / "test.pt", weights_only=True)
    assert one["index"].tolist() == two["index"].tolist() == list(range(21))
    assert torch.equal(one["label"], two["label"]) and one["label"].tolist() == [i % 10 for i in range(21)]
    for name, shape in (("s1", (21, 32)), ("s2", (21, 64)), ("avgpool", (21, 16))):
        assert tuple(two["features"][name].shape) == shape
        torch.testing.assert_close(two["features"][name], one["features"][name], rtol=1e-5, atol=1e-6)
    ranks = [torch.load(tmp_path / "2" / "features" / f"test_rank{r}.pt", weights_only=True) for r in (0, 1)]
    assert [len(r["index"]) for r in ranks] == [11, 11]  # 21 images: one padded repeat
    assert (tmp_path / "2" / "features" / "train.pt").exists()
    _same_embedding_files(tmp_path / "1" / "features", tmp_path / "2" / "features", two)


def _same_embedding_files(one, two, record):
    """The .npy, paths.txt and parquet files of 1 and 2 ranks agree (1e-5) and hold the .pt's rows."""
    import numpy as np
    import pyarrow.parquet as pq

    paths = (two / "test_paths.txt").read_text().splitlines()
    assert paths == record["path"] == [f"synthetic[{i}]" for i in range(21)]
    assert (one / "test_paths.txt").read_text() == (two / "test_paths.txt").read_text()
    for name in ("labels", "indices"):
        assert np.array_equal(np.load(one / f"test_{name}.npy"), np.load(two / f"test_{name}.npy"))
    assert np.load(two / "test_labels.npy").tolist() == record["label"].tolist()
    for name, rows in record["features"].items():
        np.testing.assert_allclose(
            np.load(one / f"test_{name}.npy"), np.load(two / f"test_{name}.npy"), rtol=1e-5, atol=1e-6
        )
        assert np.array_equal(np.load(two / f"test_{name}.npy"), rows.numpy())
        table = pq.read_table(two / f"test_{name}.parquet").to_pydict()
        assert (
            table["path"] == paths
            and table["index"] == list(range(21))
            and table["label"] == record["label"].tolist()
        )
        np.testing.assert_array_equal(np.array(table["embedding"], dtype=np.float32), rows.numpy())


def test_extracted_features_are_averaged_over_the_configured_views(tmp_path):
    """The engines pass BENCHMARK.FEATURE_VIEWS down: extract_features with "dihedral" on 2 sharded
    gloo ranks writes the 8-view means of each test image's features, as one unsharded process
    computes them."""
    _save_pretrained(tmp_path / "pretrained.pt", randomise_bn=False)
    argv = _tiny(
        tmp_path,
        "config.JOB=extract_features",
        "config.BENCHMARK.FEATURE_VIEWS=dihedral",
        f"config.MODEL.WEIGHTS_INIT.PARAMS_FILE={tmp_path / 'pretrained.pt'}",
    )
    run_on_ranks(_engine_on_ranks, 2, extract_features, argv)
    written = torch.load(tmp_path / "features" / "test.pt", weights_only=True)
    assert written["index"].tolist() == list(range(21))
    cfg = load_config([*argv, "config.MODEL.FSDP_CONFIG.AUTO_SETUP_FSDP=False"])  # the engine ran sharded
    trunk, dims = common.build_frozen_trunk(cfg, CPU)
    loader = build_loader(cfg.DATA, "TEST", seed=cfg.SEED_VALUE, device=CPU, rank=0, world_size=1)
    images = torch.cat([batch["crops"][0] for batch in loader])
    expected = common.trunk_features(trunk, images, list(dims), cfg.BENCHMARK.POOL_SIZE, views="dihedral")
    single = common.trunk_features(trunk, images, list(dims), cfg.BENCHMARK.POOL_SIZE)
    for name in dims:
        torch.testing.assert_close(written["features"][name], expected[name], rtol=1e-5, atol=1e-6)
        assert not torch.allclose(written["features"][name], single[name], atol=1e-3)


def test_knn_engine_counts_every_test_image_once(tmp_path):
    from vistrain.benchmarks import knn

    argv = _tiny(tmp_path, "config.JOB=knn")
    run_on_ranks(_engine_on_ranks, 2, knn, argv)
    metrics = json.loads((tmp_path / "metrics.json").read_text())
    for result in metrics["results"].values():
        assert result["num_images"] == 21 and result["bank_size"] == 32
        assert 0 <= result["top1"] <= result["top5"] <= 100


# --------------------------------------------------------------------------------------------
# bad input


def test_unlabelled_data_is_refused(tmp_path):
    lines = []
    for i in range(4):
        Image.new("RGB", (16, 16), (i * 40, 0, 0)).save(tmp_path / f"{i}.png")
        lines.append(f"{i}.png -1")
    (tmp_path / "list.txt").write_text("\n".join(lines) + "\n")
    unlabelled = [
        "config.DATA.TRAIN.DATA_SOURCES=[disk_filelist]",
        f"config.DATA.TRAIN.DATA_PATHS=[{tmp_path / 'list.txt'}]",
    ]
    cfg = load_config(_tiny(tmp_path / "run", *unlabelled))
    with pytest.raises(ValueError, match=r"DATA.TRAIN has 4 of 4 images without a label"):
        common.check_labels(build_loader(cfg.DATA, "TRAIN", seed=0, device=CPU).dataset, "TRAIN")
    with pytest.raises(RuntimeError, match=r"without a label"):  # the engine says so before any work
        run_on_ranks(_engine_on_ranks, 1, linear_eval, _tiny(tmp_path / "run", *unlabelled))


def _frozen(weights, *overrides):
    cfg = load_config(
        _tiny(
            "unused",
            "config.MODEL.FSDP_CONFIG.AUTO_SETUP_FSDP=False",
            f"config.MODEL.WEIGHTS_INIT.PARAMS_FILE={weights}",
            *overrides,
        )
    )
    return common.build_frozen_trunk(cfg, CPU)


def test_mismatched_checkpoint_is_refused(tmp_path):
    wider = tmp_path / "wider.pt"
    _save_pretrained(wider, "config.MODEL.TRUNK.REGNET.W_0=16", "config.MODEL.HEAD.DIMS=[32,32,16]")
    with pytest.raises(
        CheckpointError, match=r"block1-0.proj.0.weight has shape \(16, 8, 1, 1\).*\(8, 8, 1, 1\)"
    ):
        _frozen(wider)
    deeper = tmp_path / "deeper.pt"  # one more stage: the shared keys match, the extra ones don't
    _save_pretrained(deeper, "config.MODEL.TRUNK.REGNET.DEPTH=3", "config.MODEL.HEAD.DIMS=[32,32,16]")
    with pytest.raises(
        ValueError, match=r"does not match the trunk.*missing none; unexpected trunk.trunk_output"
    ):
        _frozen(deeper)
    partial = tmp_path / "partial.pt"
    state = _save_pretrained(partial)
    torch.save({k: v for k, v in state.items() if "block2" not in k}, partial)
    with pytest.raises(ValueError, match=r"missing trunk.trunk_output.block2"):
        _frozen(partial)
    trunk, _ = _frozen(tmp_path / "deeper.pt", "config.MODEL.TRUNK.REGNET.DEPTH=3")  # the right config loads
    assert not any(p.requires_grad for p in trunk.parameters())


# --------------------------------------------------------------------------------------------
# linear evaluation: learning-rate grid chosen on held-out training images


def test_holdout_split_is_stratified_disjoint_and_seeded():
    labels = [0] * 50 + [1] * 30 + [2] * 7 + [3] * 1
    fit, holdout = lr_grid.holdout_split(labels, 0.2, seed=3)
    assert sorted(fit + holdout) == list(range(len(labels))) and not set(fit) & set(holdout)
    per_class = [sum(labels[i] == c for i in holdout) for c in range(4)]
    assert per_class == [10, 6, 1, 0]  # round(0.2 * n); a class of one keeps its image for fitting
    assert lr_grid.holdout_split(labels, 0.2, seed=3) == (fit, holdout)
    assert lr_grid.holdout_split(labels, 0.2, seed=4)[1] != holdout
    with pytest.raises(ValueError, match="LINEAR_HOLDOUT_FRACTION"):
        lr_grid.holdout_split(labels, 1.0, seed=0)


def test_stratified_folds_cover_every_sample_once_balanced_per_class_and_seeded():
    labels = [0] * 50 + [1] * 30 + [2] * 7 + [3] * 1
    splits = lr_grid.stratified_folds(labels, 5, seed=3)
    holdouts = [holdout for _, holdout in splits]
    assert sorted(i for h in holdouts for i in h) == list(range(len(labels)))  # each sample held out once
    for fit, holdout in splits:
        assert sorted(fit + holdout) == list(range(len(labels))) and not set(fit) & set(holdout)
    sizes = [len(h) for h in holdouts]
    assert max(sizes) - min(sizes) <= 1 and sum(sizes) == 88
    for c, count in enumerate([50, 30, 7, 1]):
        per_fold = [sum(labels[i] == c for i in h) for h in holdouts]
        assert max(per_fold) - min(per_fold) <= 1 and sum(per_fold) == count
    assert lr_grid.stratified_folds(labels, 5, seed=3) == splits
    assert lr_grid.stratified_folds(labels, 5, seed=4) != splits
    for bad in (1, 89):
        with pytest.raises(ValueError, match="LINEAR_LR_FOLDS"):
            lr_grid.stratified_folds(labels, bad, seed=0)


def test_pooled_top1_sums_hits_over_folds_instead_of_averaging_percentages():
    folds = [
        {"s2_lr0": {"top1": 50.0, "num_images": 2}, "s2_lr1": {"top1": 100.0, "num_images": 2}},
        {"s2_lr0": {"top1": 100.0, "num_images": 8}, "s2_lr1": {"top1": 75.0, "num_images": 8}},
    ]
    pooled = lr_grid.pooled_top1(folds)
    assert pooled == {"s2_lr0": 90.0, "s2_lr1": 80.0}  # 9/10 and 8/10; mean percentages would say 75 / 87.5


def test_choose_learning_rates_takes_the_best_holdout_score_ties_to_the_smaller_lr():
    grid = [0.01, 0.1, 1.0]
    scores = {"s2_lr0": 90.0, "s2_lr1": 95.0, "s2_lr2": 93.0, "s3_lr0": 80.0, "s3_lr1": 70.0, "s3_lr2": 80.0}
    assert lr_grid.choose_learning_rates(scores, ["s2", "s3"], grid) == {"s2": 0.1, "s3": 0.01}


def test_grid_heads_train_exactly_like_separate_runs_at_their_lr():
    """A head of the grid at lr b ends where a lone head trained with base lr b ends."""
    cfg = load_config(_tiny("unused", "config.MODEL.FSDP_CONFIG.AUTO_SETUP_FSDP=False"))
    trunk, dims = common.build_frozen_trunk(cfg, CPU)
    source = FrozenFeatures(trunk, ["s2"], cfg.BENCHMARK.POOL_SIZE, None, CPU)
    loader = build_loader(cfg.DATA, "TRAIN", seed=0, device=CPU, rank=0, world_size=1)
    meter = _SilentMeter()
    torch.manual_seed(0)
    grid = LinearHeads(dims, 10, {"s2_lr0": "s2", "s2_lr1": "s2"}, {"s2_lr0": 0.02, "s2_lr1": 0.3})
    lone = LinearHeads({"s2": dims["s2"]}, 10)
    lone.heads["s2"].load_state_dict(grid.heads["s2_lr1"].state_dict())
    train_heads(source, grid, loader, cfg.OPTIMIZER, meter)
    opt_cfg = cfg.OPTIMIZER.clone()
    opt_cfg.defrost()
    opt_cfg.param_schedulers.lr.base_value = 0.3
    train_heads(source, lone, loader, opt_cfg, meter)
    for key, value in lone.heads["s2"].state_dict().items():
        torch.testing.assert_close(grid.heads["s2_lr1"].state_dict()[key], value, rtol=1e-6, atol=1e-7)
    assert not torch.allclose(grid.heads["s2_lr0"][1].weight, grid.heads["s2_lr1"][1].weight)


class _SilentMeter:
    """Stands in for the logging meter in one-process head training."""

    def update(self, loss, num_images, num_skipped=0):
        pass

    def should_log(self, iteration):
        return False


def test_linear_eval_with_lr_grid_reports_the_lr_chosen_on_held_out_training_images(tmp_path):
    run_dir = tmp_path / "run"
    argv = _tiny(
        run_dir,
        "config.BENCHMARK.LINEAR_LRS=[0.001,0.5]",
        "config.BENCHMARK.LINEAR_HOLDOUT_FRACTION=0.25",
        "config.DATA.TRAIN.SYNTHETIC_SIZE=48",
    )
    proc = _launch_linear_eval(argv)
    metrics = json.loads((run_dir / "metrics.json").read_text())
    assert list(metrics["results"]) == ["s1", "s2", "avgpool"]
    for result in metrics["results"].values():
        assert result["lr"] in (0.001, 0.5) and 0 <= result["holdout_top1"] <= 100
        assert result["num_images"] == 21
    held_out, fit = re.search(
        r"lr grid on (\d+) held-out training images \((\d+) fit\)", proc.stdout
    ).groups()
    assert 0 < int(held_out) < int(fit) and int(held_out) + int(fit) == 48
    heads = torch.load(run_dir / "linear_heads.pt", weights_only=True)
    assert sorted({k.split(".")[1] for k in heads}) == ["avgpool", "s1", "s2"]  # the final heads only


def test_linear_eval_with_k_fold_lr_selection_holds_out_every_training_image_once(tmp_path):
    run_dir = tmp_path / "run"
    argv = _tiny(
        run_dir,
        "config.BENCHMARK.LINEAR_LRS=[0.001,0.5]",
        "config.BENCHMARK.LINEAR_LR_FOLDS=3",
        "config.DATA.TRAIN.SYNTHETIC_SIZE=48",
    )
    proc = _launch_linear_eval(argv)
    assert re.search(
        r"lr grid on 48 held-out training images \(32 fit, 3-fold cross-validation\)", proc.stdout
    )
    # what the console shows: a header naming the cross-validation, one line per fold with the
    # time left for the whole job, the final fit, a table; the meter's lines only in log.txt
    lines = [line.split("vistrain] ", 1)[1] for line in proc.stdout.splitlines() if "vistrain] " in line]
    assert (
        "choosing each feature's lr among 0.001, 0.5 by 3-fold cross-validation on DATA.TRAIN"
        in "\n".join(lines)
    )
    folds = [line for line in lines if line.startswith("fold ")]
    assert [line.split(" done")[0] for line in folds] == ["fold 1/3", "fold 2/3", "fold 3/3"]
    assert all(re.search(r"; eta \d+:\d\d:\d\d$", line) for line in folds)
    assert not any(line.startswith("epoch ") for line in lines)
    assert "epoch 1/1  it " in (run_dir / "log.txt").read_text()
    header = lines[
        lines.index(next(line for line in lines if line.startswith("linear evaluation on DATA.TEST"))) + 1
    ]
    assert header.split() == ["feature", "dim", "lr", "held-out", "top-1", "top-5"]
    metrics = json.loads((run_dir / "metrics.json").read_text())
    for result in metrics["results"].values():
        # a pooled top-1 over 48 images is a whole number of hits
        assert result["lr"] in (0.001, 0.5) and round(result["holdout_top1"] * 48 / 100, 6).is_integer()


@pytest.mark.parametrize("views", ["identity", "dihedral"])
def test_cached_train_features_train_the_same_heads_as_the_trunk_every_epoch(views):
    """With an un-augmented TRAIN transform the bank computed once stands in for the trunk exactly
    (also when each image's features are averaged over views)."""
    cfg = load_config(
        _tiny("unused", "config.MODEL.FSDP_CONFIG.AUTO_SETUP_FSDP=False", "config.OPTIMIZER.num_epochs=2")
    )
    trunk, dims = common.build_frozen_trunk(cfg, CPU)
    source = FrozenFeatures(trunk, list(dims), cfg.BENCHMARK.POOL_SIZE, None, CPU, views)
    cached = cache_features(source, cfg.DATA, seed=0)
    assert cached.bank["s2"].shape == (32, dims["s2"])
    loader = build_loader(cfg.DATA, "TRAIN", seed=0, device=CPU, rank=0, world_size=1)
    heads = []
    for features in (source, cached):
        torch.manual_seed(0)
        heads.append(LinearHeads(dims, 10))
        train_heads(features, heads[-1], loader, cfg.OPTIMIZER, _SilentMeter())
    for key, value in heads[0].state_dict().items():
        torch.testing.assert_close(heads[1].state_dict()[key], value, rtol=1e-5, atol=1e-6, msg=key)
