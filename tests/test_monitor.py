"""The training monitor (vistrain/training/monitor.py): RankMe and feature std against their
formulas; on real gloo runs of the tiny recipes, the online kNN equals the knn job on the saved
checkpoint, training is unchanged by the monitor, a collapsing run warns (once) and with
STOP_ON_COLLAPSE exits 3, bad MONITOR values exit 2, and 2 sharded ranks measure what 1 process does."""

import json
import math
import shutil
from pathlib import Path

import pytest
import torch

from vistrain import cli
from vistrain.benchmarks.common import one_view_batches
from vistrain.benchmarks.knn import knn
from vistrain.checkpoint import find_latest_checkpoint
from vistrain.data import build_loader
from vistrain.distributed.testing import run_on_ranks
from vistrain.methods import build_model, load_config
from vistrain.runtime.parallel import parallelize
from vistrain.training import held_out
from vistrain.training.monitor import (
    Monitor,
    collapse_reasons,
    feature_name,
    feature_std,
    is_due,
    knn_config,
    rankme,
    trunk_call,
    watching,
)
from vistrain.training.trainer import train


def _tiny(run_dir, *overrides, config="test/simclr_tiny"):
    return [f"config={config}", f"config.CHECKPOINT.DIR={run_dir}", *overrides]


# a real collapse: VICReg's invariance term alone is minimised by a constant output, and at lr 0.5
# the tiny trunk gets there within its first epoch (RankMe ~1.05, feature std ~0.001) and stays
# there: the verdict needs two passes in a row
COLLAPSING = (
    "config.LOSS.vicreg_loss.variance_weight=0",
    "config.LOSS.vicreg_loss.covariance_weight=0",
    "config.OPTIMIZER.num_epochs=2",
    "config.OPTIMIZER.param_schedulers.lr.base_value=0.5",
    "config.OPTIMIZER.param_schedulers.lr.name=multistep",  # then 0.0005 in the second epoch
    "config.OPTIMIZER.param_schedulers.lr.milestones=[1]",
    "config.OPTIMIZER.param_schedulers.lr.gamma=0.001",
    "config.MONITOR.EVERY_EPOCHS=1",
    # its passes read RankMe 1.3 and 1.9 (the second pass's BN running statistics have moved on):
    # a bar of 3 makes both verdicts stable against small changes of the views
    "config.MONITOR.RANKME_MIN=3.0",
)


def _train_on_rank(rank, world_size, *argvs):
    for argv in argvs:  # several runs, one after the other, in the same processes
        train(load_config(argv))


def _records(run_dir) -> list:
    return [json.loads(line) for line in Path(run_dir, "metrics.jsonl").read_text().splitlines()]


# --------------------------------------------------------------------------------------------
# the measures


@pytest.mark.parametrize("rank", [1, 3, 16])
def test_rankme_of_equal_singular_values_is_the_rank(rank):
    """r equal non-zero singular values: p_k = 1/r (+ eps), exp(entropy) = r."""
    basis = torch.linalg.qr(torch.randn(64, 64, dtype=torch.float64))[0]
    embeddings = 3.0 * basis[:, :rank] @ torch.linalg.qr(torch.randn(32, 32, dtype=torch.float64))[0][:rank]
    assert rankme(embeddings) == pytest.approx(rank, rel=1e-4)


def test_rankme_of_random_low_rank_embeddings():
    """A random rank-8 (512, 64) matrix: at most 8, and most of it (its singular values spread);
    full-rank Gaussian (4096, 32) embeddings: close to 32."""
    generator = torch.Generator().manual_seed(0)
    low = torch.randn(512, 8, generator=generator) @ torch.randn(8, 64, generator=generator)
    assert 0.75 * 8 < rankme(low) <= 8 + 1e-3
    assert rankme(torch.randn(4096, 32, generator=generator)) > 0.95 * 32
    assert rankme(torch.ones(100, 16)) == pytest.approx(1.0, abs=1e-4)  # one direction: collapsed
    assert math.isnan(rankme(torch.full((8, 4), float("nan"))))  # diverged weights: no SVD error


def test_feature_std_is_the_mean_std_of_normalised_dimensions():
    generator = torch.Generator().manual_seed(0)
    features = torch.randn(20000, 64, generator=generator) * 5 + 0.1
    assert feature_std(features) == pytest.approx(1 / math.sqrt(64), rel=0.02)  # spread: 1/sqrt(D)
    assert feature_std(torch.ones(50, 8) * 7) == 0.0  # one point: 0
    two = torch.tensor([[3.0, 4.0], [0.0, 2.0]])  # normalised rows (0.6, 0.8), (0, 1)
    expected = (
        torch.tensor([0.6, 0.0], dtype=torch.float64).std()
        + torch.tensor([0.8, 1.0], dtype=torch.float64).std()
    ) / 2
    assert feature_std(two) == pytest.approx(float(expected), rel=1e-12)


def test_collapse_rules():
    healthy = {"rankme": 12.0, "feature_std": 0.1}
    assert collapse_reasons(healthy, 12.0, 64, 1.5, 0.1) == ""
    assert "RANKME_MIN" in collapse_reasons({**healthy, "rankme": 1.2}, 12.0, 64, 1.5, 0.1)
    assert "fell 10x from its peak 150" in collapse_reasons(healthy, 150.0, 64, 1.5, 0.1)
    assert collapse_reasons(healthy, 119.0, 64, 1.5, 0.1) == ""
    assert "STD_MIN / sqrt(64) = 0.0125" in collapse_reasons(
        {**healthy, "feature_std": 0.01}, 12.0, 64, 1.5, 0.1
    )
    assert [e for e in range(1, 8) if is_due(e, 7, 3)] == [3, 6, 7]
    assert not any(is_due(e, 7, 0) for e in range(1, 8))


def test_a_vit_sequence_is_watched_as_its_class_token_or_mean_patch_token():
    """The tiny DINOv2 ViT (OUT_FEATURES [sequence]): the monitor watches, and asks the knn job for,
    "cls" (without a class token "avgpool"); its feature path turns the trunk's (N, 1 + 16, 16)
    sequence into the (N, 16) feature the trunk itself gives (not a pooling of it to 4 numbers)."""
    images = torch.randn(5, 3, 16, 16)
    labelled = [(images, torch.zeros(5, dtype=torch.long), torch.arange(5))]
    for class_token, name in ((True, "cls"), (False, "avgpool")):
        cfg = load_config(
            _tiny("unused", f"config.MODEL.TRUNK.VIT.CLASS_TOKEN={class_token}", config="test/dinov2_tiny")
        )
        assert feature_name(cfg) == name and [name] == knn_config(cfg).BENCHMARK.FEATURES
        torch.manual_seed(0)
        model = build_model(cfg.MODEL).eval()
        monitor = Monitor(cfg, model, _Meter(), 2, torch.device("cpu"))
        with torch.no_grad():
            sequence = model.trunk(images)["sequence"]
            features = monitor._extract(trunk_call(model), labelled)[0]
            model.trunk.out_features = [name]
            own = model.trunk(images)[name]
        assert sequence.shape == (5, 16 + class_token, 16) and features.shape == (5, 16)
        torch.testing.assert_close(features, own, rtol=0, atol=0)


# --------------------------------------------------------------------------------------------
# real runs


def _knn_job_on_rank(rank, world_size, train_argv, checkpoint, out_dir):
    cfg = knn_config(load_config(train_argv))
    cfg.defrost()
    cfg.MODEL.WEIGHTS_INIT.PARAMS_FILE = str(checkpoint)
    cfg.MODEL.WEIGHTS_INIT.SKIP_LAYERS = ["head."]
    cfg.CHECKPOINT.DIR = str(out_dir)
    cfg.freeze()
    knn(cfg)


def test_online_knn_equals_the_knn_job_and_training_is_unchanged(tmp_path):
    """2 sharded ranks, a pass after each epoch (the second reads the images the first kept, in
    MONITOR.BATCHSIZE_PER_REPLICA batches): the last pass's kNN top-1 is the knn job's on
    checkpoint_8 exactly; the losses equal those of the run without monitor; a healthy run does
    not warn; monitor.png is written."""
    sharded = ("config.MODEL.FSDP_CONFIG.AUTO_SETUP_FSDP=True", "config.LOG_FREQUENCY=1")
    watch = ("config.MONITOR.EVERY_EPOCHS=1", "config.MONITOR.BATCHSIZE_PER_REPLICA=40")
    watched = _tiny(tmp_path / "on", *sharded, *watch)
    run_on_ranks(_train_on_rank, 2, watched, _tiny(tmp_path / "off", *sharded))
    on, off = _records(tmp_path / "on"), _records(tmp_path / "off")
    monitor = [r for r in on if "rankme" in r]
    assert [(r["epoch"], r["iteration"]) for r in monitor] == [(0, 4), (1, 8)]
    assert [(r["iteration"], r["loss"]) for r in on if "loss" in r] == [
        (r["iteration"], r["loss"]) for r in off
    ]

    run_on_ranks(_knn_job_on_rank, 2, watched, tmp_path / "on" / "checkpoint_8", tmp_path / "knn")
    offline = json.loads((tmp_path / "knn" / "metrics.json").read_text())["results"]["avgpool"]
    assert monitor[-1]["knn_top1"] == offline["top1"]
    log = (tmp_path / "on" / "log.txt").read_text()
    assert "monitor epoch 2: knn_top1 " in log and "collapsed" not in log
    assert (tmp_path / "on" / "monitor.png").stat().st_size > 0


def test_ddp_training_is_unchanged_by_the_monitor(tmp_path):
    """2 DDP ranks (no sharding), a pass after the first of 2 epochs: every loss of the second
    epoch is the one of the run without monitor (generators, BatchNorm buffers, train mode put back)."""
    ddp = ("config.MODEL.FSDP_CONFIG.AUTO_SETUP_FSDP=False", "config.LOG_FREQUENCY=1")
    watched = _tiny(tmp_path / "on", *ddp, "config.MONITOR.EVERY_EPOCHS=1", "config.MONITOR.KNN=False")
    run_on_ranks(_train_on_rank, 2, watched, _tiny(tmp_path / "off", *ddp))
    on, off = _records(tmp_path / "on"), _records(tmp_path / "off")
    assert [(r["epoch"], r["iteration"]) for r in on if "rankme" in r] == [(0, 4), (1, 8)]
    losses = [(r["iteration"], r["loss"]) for r in on if "loss" in r]
    assert [r[0] for r in losses] == list(range(1, 9))
    assert losses == [(r["iteration"], r["loss"]) for r in off]


def test_held_out_images_are_read_once_and_the_same_every_pass(monkeypatch):
    """A small held-out set is read through its loader once, then from memory (no loader):
    the same tensors every pass; one larger than KEEP_BYTES is read through its loader each pass."""
    cfg = knn_config(load_config(_tiny("unused", "config.MONITOR.BATCHSIZE_PER_REPLICA=24")))
    assert cfg.DATA.TRAIN.BATCHSIZE_PER_REPLICA == cfg.DATA.TEST.BATCHSIZE_PER_REPLICA == 24
    for keep_bytes, kept in ((held_out.KEEP_BYTES, True), (1000, False)):
        monkeypatch.setattr(held_out, "KEEP_BYTES", keep_bytes)
        loader = build_loader(cfg.DATA, "TEST", seed=cfg.SEED_VALUE, device=torch.device("cpu"))
        images = held_out.HeldOutImages(loader, torch.device("cpu"))
        first, second = list(images), list(images)
        assert (images.loader is None) == kept and (images.kept is not None) == kept
        assert [len(batch[0]) for batch in first] == [24] * 10 + [16]  # 256 images, one process
        for one, two in zip(first, second):
            assert all(torch.equal(a, b) for a, b in zip(one, two))
        reference = [(x, b["label"], b["index"]) for x, b in one_view_batches(loader, torch.device("cpu"))]
        assert all(torch.equal(a, b) for one, two in zip(first, reference) for a, b in zip(one, two))


def _measure_on_rank(rank, world_size, argv, shard):
    cfg = load_config(argv)
    torch.manual_seed(0)
    model = parallelize(build_model(cfg.MODEL), cfg.MODEL, torch.device("cpu"), shard=shard)
    out = []
    for with_knn in (True, False):  # without kNN: RankMe and std of evenly spaced DATA.TRAIN images
        run_cfg = cfg.clone()
        run_cfg.defrost()
        run_cfg.MONITOR.KNN = with_knn
        with watching(model):
            out.append(Monitor(run_cfg, model, None, 2, torch.device("cpu")).measure())
    assert model.training  # put back
    return out


def test_two_sharded_ranks_measure_what_one_process_does(tmp_path):
    argv = _tiny(tmp_path, "config.MONITOR.EVERY_EPOCHS=1", "config.MONITOR.NUM_IMAGES=21")
    one = run_on_ranks(_measure_on_rank, 1, argv, False)[0]  # DDP of one
    two = run_on_ranks(_measure_on_rank, 2, argv, True)
    assert two[0] == two[1]  # the same numbers on every rank: the collapse decision agrees
    for (single, dim), (sharded, sharded_dim) in zip(one, two[0]):
        assert dim == sharded_dim == 16 and single.keys() == sharded.keys()
        assert single.get("knn_top1") == sharded.get("knn_top1")
        for name in ("rankme", "feature_std"):
            assert sharded[name] == pytest.approx(single[name], rel=1e-5)
    assert "knn_top1" in one[0][0] and "knn_top1" not in one[1][0]


class _Meter:
    writer = None

    def write_values(self, record, tag):
        pass


def test_a_collapse_is_told_only_when_two_passes_in_a_row_show_it(caplog):
    """Narrow features on one pass that spread again by the next (early DINO) stay quiet."""
    monitor = Monitor(
        load_config(["config=test/vicreg_tiny"]), torch.nn.Identity(), _Meter(), 9, torch.device("cpu")
    )
    healthy, narrow = {"rankme": 12.0, "feature_std": 0.1}, {"rankme": 12.0, "feature_std": 0.001}
    seconds = {"monitor_seconds": 0.0, "train_seconds": 0.0}
    for epoch, values in enumerate([narrow, healthy, narrow, healthy], 1):
        monitor._report(values, 64, epoch, epoch, seconds)
    assert not monitor.warned
    monitor._report(narrow, 64, 5, 5, seconds)
    monitor._report(narrow, 64, 6, 6, seconds)
    assert monitor.warned and "collapsed by epoch 6" in caplog.text


# the demos' kNN top-1 (%) at their passes (epoch: top-1) against their untrained trunk's 73.33%
# on 360 images (bar 77.99%): SimSiam's rises late; BYOL's as it was stays at the bar
SIMSIAM = {4: 68.61, 8: 68.61, 12: 69.17, 16: 75.56, 20: 80.56, 24: 83.89, 28: 85.56, 36: 88.89, 40: 88.06}
BYOL_AS_IT_WAS = {14: 71.67, 16: 73.61, 18: 76.39, 20: 77.50, 22: 75.83, 24: 73.61, 40: 76.39}


@pytest.mark.parametrize("series, told", [(SIMSIAM, None), (BYOL_AS_IT_WAS, 22)])
def test_no_better_than_before_training_is_told_on_two_passes_in_a_row(caplog, series, told):
    """From half the run on, two passes in a row under the bar: a kNN that rises late (the SimSiam
    demo's, under the bar up to epoch 16 of 40) is not told; one that stays at the untrained
    trunk's (the BYOL demo's before its recipe changed) is, once, at the second such pass."""
    cfg = load_config(["config=test/vicreg_tiny"])
    monitor = Monitor(cfg, torch.nn.Identity(), _Meter(), 40, torch.device("cpu"))
    monitor.history.baseline = (73.33, 360)
    seconds = {"monitor_seconds": 0.0, "train_seconds": 0.0}
    for epoch, top1 in series.items():
        monitor._report({"knn_top1": top1, "rankme": 12.0, "feature_std": 0.1}, 64, epoch, epoch, seconds)
        assert monitor.warned_baseline == (told is not None and epoch >= told)
    assert caplog.text.count("learns no better than doing nothing") == (told is not None)


def test_a_resumed_run_keeps_the_peak_rankme_of_the_passes_before_its_checkpoint(tmp_path):
    """Passes at iterations 4 and 8 before the checkpoint at 12; the one at 12 came after that
    checkpoint (the resumed run makes it again) and one at 16 the earlier run made past it: only
    the first two count, and the pass at 8 that fell 10x from the peak makes the resumed run's
    first such pass the second in a row."""
    passes = [(4, 30.0, 0), (8, 2.5, 1), (12, 50.0, 0), (16, 40.0, 0)]
    lines = [
        json.dumps({"iteration": i, "epoch": i // 4 - 1, "rankme": r, "collapse_suspect": s})
        for i, r, s in passes
    ]
    (tmp_path / "metrics.jsonl").write_text(
        "\n".join([json.dumps({"iteration": 1, "loss": 5.0}), *lines]) + "\n"
    )
    cfg = load_config(_tiny(tmp_path, "config.MONITOR.EVERY_EPOCHS=1"))
    resumed = Monitor(cfg, torch.nn.Identity(), _Meter(), 9, torch.device("cpu"), start=12)
    assert resumed.peak_rankme == 30.0 and resumed.suspect  # the pass at 8 fell 10x from 30
    fresh = Monitor(cfg, torch.nn.Identity(), _Meter(), 9, torch.device("cpu"))
    assert fresh.peak_rankme == 0.0 and not fresh.suspect
    # the second pass in a row below a tenth of the peak before the checkpoint: told
    seconds = {"monitor_seconds": 0.0, "train_seconds": 0.0}
    resumed._report({"rankme": 2.5, "feature_std": 0.1}, 64, 3, 12, seconds)
    assert resumed.warned


def test_a_collapsing_run_warns_once_also_across_a_resume(tmp_path):
    """The run warns once; without its last checkpoint, rerun from the first epoch's, it warns
    again: the first epoch's pass, which came after that checkpoint and the resumed run makes
    again, and the second's are two in a row."""
    argv = _tiny(tmp_path, *COLLAPSING, "config.CHECKPOINT.KEEP_LAST=2", config="test/vicreg_tiny")

    def warnings():
        return [line for line in (tmp_path / "log.txt").read_text().splitlines() if "collapsed" in line]

    run_on_ranks(_train_on_rank, 2, argv)
    assert len(warnings()) == 1
    assert "RankMe" in warnings()[0] and "OPTIMIZER.weight_decay" in warnings()[0]
    shutil.rmtree(tmp_path / "checkpoint_8")
    run_on_ranks(_train_on_rank, 2, argv)
    assert len(warnings()) == 2 and "collapsed by epoch 2" in warnings()[1]


def test_stop_on_collapse_exits_3_in_one_line_and_keeps_the_checkpoint(tmp_path, capfd):
    """The command line's own main (tools/run_distributed.py calls it; in this process its
    torch is already loaded): both ranks stop, exit 3, one line on stderr from every process
    (the ranks' included), the epoch's checkpoint complete."""
    argv = _tiny(tmp_path, *COLLAPSING, "config.MONITOR.STOP_ON_COLLAPSE=True", config="test/vicreg_tiny")
    code = cli.main(argv)
    err = capfd.readouterr().err
    assert code == 3, err[-3000:]
    lines = [line for line in err.splitlines() if line.startswith("collapsed: ")]
    assert len(lines) == 1 and "Traceback" not in err
    assert "the representation collapsed by epoch 2" in lines[0]
    assert find_latest_checkpoint(str(tmp_path)).endswith("checkpoint_8")


@pytest.mark.parametrize(
    "override, key",
    [
        ("config.MONITOR.EVERY_EPOCHS=-1", "MONITOR.EVERY_EPOCHS"),
        ("config.MONITOR.STD_MIN=2.0", "MONITOR.STD_MIN"),
        ("config.MONITOR.LABEL_FRACTION=0.0", "MONITOR.LABEL_FRACTION"),
        ("config.MONITOR.FEATURE=s9", "MONITOR.FEATURE"),
    ],
)
def test_bad_monitor_values_exit_2_in_one_line(tmp_path, capsys, override, key):
    code = cli.main(_tiny(tmp_path, "config.MONITOR.EVERY_EPOCHS=1", override))
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and key in err[0], err
