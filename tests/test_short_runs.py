"""Trial runs just work: no recipe is one line listing them, warm-ups longer than the run take half
of it (one note), and the first step of any run trains at an lr above 0."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from vistrain import cli
from vistrain.config import available_configs
from vistrain.config.warmups import fit_warmups
from vistrain.methods import get_defaults, load_config, method_warmups
from vistrain.optim import build_lr_schedule

REPO = Path(__file__).resolve().parents[1]


# --------------------------------------------------------------------------------------------
# no recipe


def test_overrides_without_a_recipe_are_one_line_listing_the_recipes(tmp_path, capsys):
    """Without config= the defaults would train on synthetic images on one rank, silently."""
    assert cli.main(["config.OPTIMIZER.num_epochs=1", f"config.CHECKPOINT.DIR={tmp_path / 'run'}"]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1, lines
    assert lines[0].startswith("config error: no recipe given: add config=NAME, one of ")
    assert ", ".join(available_configs()) in lines[0] and "config=regnet_fsdp is the quick start" in lines[0]
    assert not (tmp_path / "run").exists()


def test_the_planner_refuses_no_recipe_alike(capsys):
    tool = _plan_memory_tool()
    assert tool.main(["config.OPTIMIZER.num_epochs=1"]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("config error: no recipe given: add config=NAME")


def _plan_memory_tool():
    import importlib.util

    spec = importlib.util.spec_from_file_location("plan_memory_tool", REPO / "tools" / "plan_memory.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# --------------------------------------------------------------------------------------------
# warm-ups that outlast the run


def _fit(cfg, iters_per_epoch=None):
    """What the launcher does: the lr's warm-up and the run's method's (``Method.warmups``)."""
    return fit_warmups(cfg, method_warmups(cfg), iters_per_epoch)


def test_a_one_epoch_trial_of_the_dino_demo_halves_every_warmup_in_one_note():
    cfg, note = _fit(load_config(["config=pretrain/dino_vit_demo", "config.OPTIMIZER.num_epochs=1"]))
    assert cfg.OPTIMIZER.param_schedulers.lr.warmup_epochs == 0.5
    assert cfg.LOSS.dino_loss.warmup_teacher_temp_epochs == 0  # whole epochs: the final temperature
    assert cfg.LOSS.dino_loss.freeze_last_layer_epochs == 0  # else the last layer never trains
    assert cfg.is_frozen()
    assert note == (
        "short run: warm-ups that would outlast the 1-epoch run take half of it: "
        "OPTIMIZER.param_schedulers.lr.warmup_epochs 5.0 -> 0.5, "
        "LOSS.dino_loss.warmup_teacher_temp_epochs 10 -> 0, LOSS.dino_loss.freeze_last_layer_epochs 1 -> 0 "
        "(config.yaml records them)"
    )
    _, note = _fit(load_config(["config=pretrain/dino_regnet_demo", "config.OPTIMIZER.num_epochs=8"]))
    assert note.endswith("LOSS.dino_loss.warmup_teacher_temp_epochs 10 -> 4 (config.yaml records them)")


@pytest.mark.parametrize(
    "argv",
    [
        ["config=regnet_fsdp"],  # 0.5 of 40 epochs
        ["config=pretrain/dino_vit_demo"],  # 5 of 40, the temperature over 10
        ["config=test/dino_tiny"],  # the temperature over both epochs: final in the last one
        ["config=pretrain/dino_vit_demo", "config.OPTIMIZER.num_epochs=12"],
    ],
)
def test_warmups_that_end_before_the_run_are_kept(argv):
    cfg = load_config(argv)
    assert _fit(cfg) == (cfg, None)


def test_a_one_epoch_swav_trial_freezes_its_prototypes_for_half_of_it():
    """Counted in iterations: fitted once the launcher knows the run's iterations per epoch."""
    from vistrain.jobs import iterations_per_epoch

    cfg = load_config(["config=pretrain/swav_regnet_demo", "config.OPTIMIZER.num_epochs=1"])
    assert iterations_per_epoch(cfg, 1437) == 22  # the digits, 2 ranks x 32 (DROP_LAST)
    fitted, note = _fit(cfg, 22)
    assert fitted.LOSS.swav_loss.freeze_prototypes_niters == 11
    assert note.endswith("LOSS.swav_loss.freeze_prototypes_niters 22 -> 11 (config.yaml records them)")
    assert _fit(cfg) == (cfg, None)  # iterations unknown: not fitted
    two = load_config(["config=pretrain/swav_regnet_demo", "config.OPTIMIZER.num_epochs=2"])
    assert _fit(two, 22) == (two, None)
    kept = load_config(["config=regnet_fsdp", "config.DATA.TRAIN.DROP_LAST=False"])
    assert iterations_per_epoch(kept, 1437) == 12  # 719 per rank: the last batch is short
    assert iterations_per_epoch(load_config(["config=test/benchmark_tiny"]), None) is None  # not training


def test_another_methods_warmups_are_not_touched():
    cfg = load_config(["config=regnet_fsdp", "config.OPTIMIZER.num_epochs=1"])  # SimCLR
    assert cfg.LOSS.dino_loss.freeze_last_layer_epochs == 1
    fitted, note = _fit(cfg)
    assert fitted.LOSS.dino_loss.freeze_last_layer_epochs == 1 and note is None


def _lr_cfg(num_epochs, **lr):
    cfg = get_defaults().OPTIMIZER
    cfg.num_epochs = num_epochs
    for key, value in lr.items():
        cfg.param_schedulers.lr[key] = value
    return cfg


@pytest.mark.parametrize("name", ["cosine", "constant", "multistep"])
@pytest.mark.parametrize("iters_per_epoch", [1, 2, 11])
@pytest.mark.parametrize("epochs, warmup", [(1, 0.0), (1, 0.5), (1, 0.99), (2, 1.0), (3, 2.5), (40, 0.5)])
def test_the_first_step_of_any_run_trains_above_lr_0(name, iters_per_epoch, epochs, warmup):
    """The warm-up starts at start_warmup_value 0 (the default); its first step must move."""
    cfg = _lr_cfg(epochs, name=name, base_value=0.8, end_value=0.0, warmup_epochs=warmup, milestones=[])
    lr = build_lr_schedule(cfg, iters_per_epoch)
    total = epochs * iters_per_epoch
    values = [lr(t) for t in range(total)]
    assert values[0] > 0
    assert all(0 < v <= 0.8 + 1e-12 for v in values)
    ramp = [v for t, v in enumerate(values) if t < warmup * iters_per_epoch]
    assert ramp == sorted(ramp) and (not ramp or ramp[-1] == pytest.approx(0.8))


def test_a_one_step_trial_after_the_shrink_trains_at_the_peak():
    """The report's case: a recipe's warm-up of 5 epochs, a 1-epoch run of one iteration."""
    cfg, _ = _fit(load_config(["config=pretrain/dino_vit_demo", "config.OPTIMIZER.num_epochs=1"]))
    lr = build_lr_schedule(cfg.OPTIMIZER, iterations_per_epoch=1)
    assert lr(0) == pytest.approx(0.002)


def test_a_one_epoch_dino_trial_runs_with_one_note_and_no_step_at_lr_0(tmp_path):
    """End to end through tools/run_distributed.py (2 ranks): warm-ups of 3 epochs (lr) and the
    tiny recipe's temperature over 2 in a 1-epoch run."""
    argv = [
        "config=test/dino_tiny",
        f"config.CHECKPOINT.DIR={tmp_path}",
        "config.OPTIMIZER.num_epochs=1",
        "config.OPTIMIZER.param_schedulers.lr.warmup_epochs=3",
        "config.LOSS.dino_loss.warmup_teacher_temp_epochs=3",
        "config.LOG_FREQUENCY=1",
    ]
    done = subprocess.run(
        [sys.executable, str(REPO / "tools" / "run_distributed.py"), *argv],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=REPO,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    notes = [line for line in done.stdout.splitlines() if "short run: " in line]
    assert len(notes) == 1 and notes[0].endswith(
        "short run: warm-ups that would outlast the 1-epoch run take half of it: "
        "OPTIMIZER.param_schedulers.lr.warmup_epochs 3.0 -> 0.5, LOSS.dino_loss.warmup_teacher_temp_epochs 3 -> 0, "
        "LOSS.dino_loss.freeze_last_layer_epochs 1 -> 0 (config.yaml records them)"
    )
    assert notes[0].split("] ", 1)[1] in (tmp_path / "log.txt").read_text()
    metrics = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert len(metrics) == 4 and all(m["lr"] > 0 for m in metrics)
    assert metrics[0]["lr"] == pytest.approx(0.05 / 2)  # 1 of 2 warm-up steps (0.5 of 4 iterations)
    saved = load_config([f"config={tmp_path / 'config.yaml'}"])
    assert saved.OPTIMIZER.param_schedulers.lr.warmup_epochs == 0.5
    assert saved.LOSS.dino_loss.warmup_teacher_temp_epochs == 0
