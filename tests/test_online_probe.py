"""The online linear probe (vistrain/training/online_probe.py) and the monitor's "no better than
before training" rule (vistrain/training/monitor_rules.py): the rule as a pure function; the probe
on made-up features; on real gloo runs of the tiny recipe, training unchanged by the probe
(sharded and DDP), the baseline record at iteration 0, the probe's state saved and resumed."""

import json
import os
import shutil
from pathlib import Path

import pytest
import torch

from vistrain.distributed import comm
from vistrain.distributed.testing import run_on_ranks
from vistrain.methods import load_config
from vistrain.training.monitor_rules import History, baseline_margin, no_better_than_baseline
from vistrain.training.online_probe import OnlineProbe
from vistrain.training.trainer import train

# --------------------------------------------------------------------------------------------
# the rule


def test_baseline_margin_is_two_points_or_two_standard_errors():
    """SE = 100 sqrt(p (1 - p) / n): 73% on 360 images (the digits' val split) -> 2.34, so 4.68
    points; 50% on 10,000 images -> 0.5, so the 2-point floor; an empty count is taken as 1 image."""
    assert baseline_margin(73.0, 360) == pytest.approx(2 * 100 * (0.73 * 0.27 / 360) ** 0.5)
    assert baseline_margin(73.0, 360) == pytest.approx(4.680, abs=1e-3)
    assert baseline_margin(50.0, 10_000) == 2.0
    assert baseline_margin(100.0, 50) == 2.0 and baseline_margin(0.0, 50) == 2.0
    assert baseline_margin(50.0, 0) == 100.0


@pytest.mark.parametrize(
    "knn, baseline, images, passes, progress, warns",
    [
        (77.0, 73.0, 360, 2, 0.5, True),  # within 2 SE (4.68 points) of the untrained trunk
        (77.7, 73.0, 360, 5, 0.5, False),  # 4.7 points above
        (70.0, 73.0, 360, 2, 1.0, True),  # below it
        (60.0, 73.0, 360, 1, 0.5, False),  # one pass: too early to tell
        (76.67, 73.33, 360, 3, 3 / 40, False),  # the quick start's third epoch of 40: too early
        (76.67, 73.33, 360, 5, 20 / 40, True),  # the same half way through the run
        (75.56, 73.33, 360, 4, 16 / 40, False),  # the SimSiam demo's epoch 16 of 40: too early
        (80.56, 73.33, 360, 5, 20 / 40, False),  # ... its epoch 20: above (88.9% after 36)
        (76.39, 73.33, 360, 20, 40 / 40, True),  # the BYOL demo's end as it was: +3.06 < 2 SE
        (51.9, 50.0, 10_000, 2, 0.5, True),  # the 2-point floor where 2 SE is 1 point
        (52.0, 50.0, 10_000, 2, 0.5, False),
        (98.0, 97.0, 25, 3, 0.5, True),  # 2 SE = 6.8 points on 25 images
        (96.11, 73.33, 360, 5, 15 / 40, False),  # the quick start's pass after epoch 15
    ],
)
def test_no_better_than_baseline(knn, baseline, images, passes, progress, warns):
    reason = no_better_than_baseline(knn, baseline, images, passes, progress)
    assert bool(reason) == warns
    if warns:
        assert (
            f"{knn:.2f}%" in reason and f"{baseline:.2f}%" in reason and f"on {images} test images" in reason
        )


def test_history_reads_the_passes_before_the_checkpoint_and_the_last_baseline():
    """A pass made again by a resumed run counts once; passes from ``start`` on do not count (the
    one at ``start`` came after the checkpoint: the resumed run makes it again); the last baseline
    record wins (a run restarted from scratch in the same folder)."""
    records = [
        {"iteration": 0, "epoch": -1, "knn_baseline": 40.0, "knn_images": 100},
        {"iteration": 4, "epoch": 0, "rankme": 5.0, "collapse_suspect": 0},
        {"iteration": 8, "epoch": 1, "rankme": 9.0, "collapse_suspect": 1},
        {"iteration": 0, "epoch": -1, "knn_baseline": 30.0, "knn_images": 256},
        {"iteration": 4, "epoch": 0, "rankme": 6.0, "collapse_suspect": 0},
        {"iteration": 12, "epoch": 2, "rankme": 50.0, "collapse_suspect": 0},
    ]
    history = History.of(records, start=12)
    assert (history.passes, history.peak_rankme, history.suspect) == (2, 9.0, True)
    assert not history.no_better
    records[2]["no_better_than_baseline"] = 1  # the last pass before the checkpoint found it
    assert History.of(records, start=12).no_better
    assert history.baseline == (30.0, 256)
    assert History.of([], 8) == History()


# --------------------------------------------------------------------------------------------
# the probe


def _probe(classes=3, seed=0, epochs=20):
    cfg = load_config(
        ["config=test/simclr_tiny", f"config.SEED_VALUE={seed}", f"config.MONITOR.PROBE_EPOCHS={epochs}"]
    )
    return OnlineProbe(classes, cfg, torch.device("cpu"))


def _blobs(generator, n):
    """Three Gaussian blobs far from the origin (the standardisation matters): (n, 6), labels."""
    centres = 20.0 + 3.0 * torch.randn(3, 6, generator=torch.Generator().manual_seed(7))
    labels = torch.arange(n) % 3
    return centres[labels] + 0.3 * torch.randn(n, 6, generator=generator), labels


def test_the_probe_fits_separable_features_on_its_own_generator(one_thread):
    """100% on held-out blobs after one pass; the run's generator untouched; two probes of one
    seed train alike, another seed differently."""
    generator = torch.Generator().manual_seed(0)
    bank, labels = _blobs(generator, 300)
    test, test_labels = _blobs(generator, 60)
    state = torch.get_rng_state()
    one, two, other = _probe(), _probe(), _probe(seed=1)
    for probe in (one, two, other):
        probe.fit(bank, labels)
    assert torch.equal(torch.get_rng_state(), state)
    assert one.top1(test, test_labels, torch.arange(60), bank) == 100.0
    assert torch.equal(one.linear.weight, two.linear.weight)
    assert not torch.equal(one.linear.weight, other.linear.weight)


def test_the_probe_state_round_trips_and_trains_on_alike(one_thread):
    """A probe loaded from another's state (weights, momentum, generator) takes the same next pass."""
    generator = torch.Generator().manual_seed(0)
    probe, other = _probe(epochs=2), _probe(epochs=2, seed=3)
    probe.fit(*_blobs(generator, 100))
    other.load_state_dict(probe.state_dict())
    bank, labels = _blobs(generator, 100)
    probe.fit(bank, labels)
    other.fit(bank, labels)
    assert all(torch.equal(a, b) for a, b in zip(probe.linear.parameters(), other.linear.parameters()))
    assert other.optimizer.state_dict()["state"][0]["momentum_buffer"].shape == (3, 6)
    fresh = _probe()  # saved before its first pass: nothing to load, built at its first fit
    assert fresh.state_dict() == {} and fresh.linear is None
    fresh.load_state_dict({})
    assert fresh.linear is None


# --------------------------------------------------------------------------------------------
# real runs


def _tiny(run_dir, *overrides):
    return [
        "config=test/simclr_tiny",
        f"config.CHECKPOINT.DIR={run_dir}",
        "config.LOG_FREQUENCY=1",
        *overrides,
    ]


def _runs_on_rank(rank, world_size, tmp):
    """Sharded with the probe on (the default; 2 epochs) and off (1 epoch, through FSDP2: its root
    set up before the baseline runs the trunk alone), DDP on and off (1 epoch); then the first run
    again without its last checkpoint: it resumes the first epoch's and saves the last one anew."""
    watch = "config.MONITOR.EVERY_EPOCHS=1"
    sharded, ddp = (
        "config.MODEL.FSDP_CONFIG.AUTO_SETUP_FSDP=True",
        "config.MODEL.FSDP_CONFIG.AUTO_SETUP_FSDP=False",
    )
    short, off = "config.OPTIMIZER.num_epochs=1", "config.MONITOR.ONLINE_PROBE=False"
    for argv in [
        _tiny(f"{tmp}/on", sharded, watch),
        _tiny(f"{tmp}/off", sharded, watch, off, short, "config.MODEL.FSDP_CONFIG.BACKEND=torch"),
        _tiny(f"{tmp}/ddp_on", ddp, watch, short),
        _tiny(f"{tmp}/ddp_off", ddp, watch, off, short),
    ]:
        train(load_config(argv))
    if rank == 0:
        shutil.move(f"{tmp}/on/checkpoint_8", f"{tmp}/first_checkpoint_8")
        os.rename(f"{tmp}/on/metrics.jsonl", f"{tmp}/first_metrics.jsonl")
    comm.barrier()
    train(load_config(_tiny(f"{tmp}/on", sharded, watch)))


def _records(path) -> list:
    return [json.loads(line) for line in Path(path).read_text().splitlines()]


def _probe_state(checkpoint: Path) -> dict:
    return torch.load(checkpoint / "rank1.pt", weights_only=True)["extra"]["probe"]


def test_training_is_unchanged_by_the_probe_whose_state_resumes(tmp_path):
    """2 gloo ranks: every loss of the first epoch of the DDP run with the probe equals the one
    without it, and so for the sharded run (without it through FSDP2: to 1e-5); the baseline
    record sits at iteration 0; the run resumed from checkpoint_4 makes the pass that came after
    that checkpoint again and reads what the uninterrupted run read, its probe saved alike."""
    run_on_ranks(_runs_on_rank, 2, str(tmp_path))
    first = _records(tmp_path / "first_metrics.jsonl")
    for with_probe, off in ((first, "off"), (_records(tmp_path / "ddp_on" / "metrics.jsonl"), "ddp_off")):
        without = _records(tmp_path / off / "metrics.jsonl")
        losses = [(r["iteration"], r["loss"]) for r in with_probe if "loss" in r][:4]
        assert [i for i, _ in losses] == [1, 2, 3, 4]
        other = [(r["iteration"], r["loss"]) for r in without if "loss" in r]
        if off == "ddp_off":
            assert losses == other
        torch.testing.assert_close(losses, other, rtol=1e-5, atol=0)
        assert all("probe_top1" not in r for r in without) and "probe_top1" in with_probe[-1]
    assert first[0] == {
        "iteration": 0,
        "epoch": -1,
        "knn_baseline": first[0]["knn_baseline"],
        "knn_images": 256,
    }
    passes = [r for r in first if "rankme" in r]
    assert [r["iteration"] for r in passes] == [4, 8] and all(0 <= r["probe_top1"] <= 100 for r in passes)
    assert all(r["no_better_than_baseline"] in (0, 1) for r in passes)

    resumed = _records(tmp_path / "on" / "metrics.jsonl")
    assert not any("knn_baseline" in r for r in resumed)  # measured once, before the first step
    again = [r for r in resumed if "rankme" in r]
    assert [(r["iteration"], r["knn_top1"], r["probe_top1"]) for r in again] == [
        (r["iteration"], r["knn_top1"], r["probe_top1"]) for r in passes
    ]
    saved, loaded = (
        _probe_state(tmp_path / "first_checkpoint_8"),
        _probe_state(tmp_path / "on" / "checkpoint_8"),
    )
    for key in ("weight", "bias"):
        assert torch.equal(saved["linear"][key], loaded["linear"][key])
    assert torch.equal(saved["generator"], loaded["generator"])
    log = (tmp_path / "on" / "log.txt").read_text()
    assert "Traceback" not in log
