"""MODEL.FSDP_CONFIG.AUTO_TUNE: the choice over exact knobs, the refusal, real runs and resume."""

import json
import re
from pathlib import Path

import pytest
import torch
import yaml
from fresh_launcher import FreshLauncher

from vistrain.config import ConfigError, explicit_keys
from vistrain.distributed.testing import run_on_ranks
from vistrain.methods import load_config
from vistrain.planner import auto_tune
from vistrain.planner import knobs as planner_knobs
from vistrain.planner import memory as planner_memory
from vistrain.planner.across_nodes import choose_across_nodes
from vistrain.planner.auto_tune import Budget, choose, planned_settings, tune_job, tune_settings
from vistrain.planner.knobs import EXACT_KNOBS, RESULT_KNOBS, exact_settings, speed_cost, with_knobs
from vistrain.planner.memory import plan
from vistrain.planner.shape import MIB, run_shape
from vistrain.training import train

ROOT = Path(__file__).resolve().parents[1]
SHARDED = ["config=test/simclr_tiny", "config.MODEL.FSDP_CONFIG.AUTO_SETUP_FSDP=True"]


@pytest.fixture
def fixed_baseline(monkeypatch):
    """The choice, not the import baseline (a subprocess), is under test."""
    monkeypatch.setattr(planner_memory, "import_baseline_mib", lambda forked=False: 700.0)


# --------------------------------------------------------------------------------------------
# the choice on synthetic plans


def _setting(granularity="block", reshard=True, ckpt=False):
    return dict(wrap_granularity=granularity, reshard_after_forward=reshard, activation_checkpointing=ckpt)


def test_choose_takes_the_fastest_setting_that_fits():
    settings = [_setting("model", False), _setting("block", True), _setting("block", True, ckpt=True)]
    peaks = [900, 500, 300]
    choice = choose(settings, peaks, budget_bytes=600, device="cpu")
    assert choice.knobs == settings[1] and choice.peak == 500
    assert choice.faster_rejected == (settings[0], 900)  # the faster one, named with its peak
    assert choice.runner_up == (settings[2], 300)
    choice = choose(settings, peaks, budget_bytes=1000, device="cpu")
    assert choice.knobs == settings[0] and choice.faster_rejected is None


def test_choose_breaks_ties_by_peak_then_by_preference():
    same_speed = [_setting("block", True), {**_setting("block", True), "prefetch_depth": 2}]
    assert speed_cost(same_speed[0], "cpu") == speed_cost(same_speed[1], "cpu")
    assert choose(same_speed, [500, 400], 1000, "cpu").knobs == same_speed[1]  # smaller peak
    assert choose(same_speed, [400, 400], 1000, "cpu").knobs == same_speed[0]  # listed first


def test_choose_when_nothing_fits_names_the_smallest_peak():
    settings = [_setting("model", False), _setting("block", True, ckpt=True)]
    choice = choose(settings, [900, 300], budget_bytes=100, device="cpu")
    assert choice.knobs is None and choice.peak == 300 and choice.smallest == settings[1]


def test_settings_hold_exact_knobs_only_and_keep_explicit_ones(fixed_baseline):
    cfg = load_config([*SHARDED, "config.MODEL.FSDP_CONFIG.reshard_after_forward=True"])
    settings = exact_settings(run_shape(cfg), "cpu", fixed=["reshard_after_forward"])
    assert all(set(s) <= set(EXACT_KNOBS) for s in settings)
    assert not any(set(s) & set(RESULT_KNOBS) for s in settings)  # precision, batch, ranks: never
    assert {s["reshard_after_forward"] for s in settings} == {True}
    assert {s["wrap_granularity"] for s in settings} == {"block", "stage", "model"}
    # checkpointing granularity varies only where checkpointing is on
    assert len({(s["activation_checkpointing"], s["checkpointing_granularity"]) for s in settings}) == 3
    clipped = load_config([*SHARDED, "config.OPTIMIZER.clip_grad_norm=1.0"])
    assert {s["step_in_backward"] for s in exact_settings(run_shape(clipped), "cpu")} == {False}
    ddp = load_config(["config=test/simclr_tiny"])  # DDP: only checkpointing is a knob
    assert {frozenset(s) for s in exact_settings(run_shape(ddp), "cpu")} == {
        frozenset({"activation_checkpointing", "checkpointing_granularity"})
    }


def test_explicit_keys_come_from_the_recipe_chain_and_the_command_line():
    keys = explicit_keys(["config=regnet_fsdp", "config.MODEL.FSDP_CONFIG.reshard_after_forward=False"])
    assert "MODEL.FSDP_CONFIG.AUTO_SETUP_FSDP" in keys and "OPTIMIZER.lars_eta" in keys
    assert "MODEL.FSDP_CONFIG.reshard_after_forward" in keys
    assert "MODEL.FSDP_CONFIG.wrap_granularity" not in keys


# --------------------------------------------------------------------------------------------
# tune_settings() on the planner


def test_tune_keeps_explicit_knobs_and_a_large_budget_picks_zero2_with_one_unit(fixed_baseline):
    cfg = load_config(SHARDED)
    result = tune_settings(cfg, explicit_keys(SHARDED), 2, Budget(1e6, "test"), "cpu")
    tuned, line = result.cfg, result.line
    fsdp = tuned.MODEL.FSDP_CONFIG
    assert (fsdp.wrap_granularity, fsdp.reshard_after_forward) == ("model", False)
    assert not tuned.MODEL.ACTIVATION_CHECKPOINTING.USE_ACTIVATION_CHECKPOINTING
    assert line.startswith("auto-tune: chose ") and "budget 1,000,000 MiB" in line
    args = [*SHARDED, "config.MODEL.FSDP_CONFIG.wrap_granularity=block"]
    result = tune_settings(load_config(args), explicit_keys(args), 2, Budget(1e6, "test"), "cpu")
    tuned, line = result.cfg, result.line
    assert tuned.MODEL.FSDP_CONFIG.wrap_granularity == "block" and "kept as set: wrap_granularity" in line
    # result knobs are never touched
    assert tuned.DATA.TRAIN.BATCHSIZE_PER_REPLICA == cfg.DATA.TRAIN.BATCHSIZE_PER_REPLICA
    assert tuned.MODEL.FSDP_CONFIG.mixed_precision is False


def test_nothing_fits_is_one_line_with_the_smallest_peak_and_the_levers(fixed_baseline):
    args = [*SHARDED, "config.MODEL.TRUNK.REGNET.NAME=regnet_y_8gf", "config.MODEL.HEAD.DIMS=[2016,512,128]"]
    cfg = load_config(args)
    smallest = min(planned_settings(run_shape(cfg), "cpu")[1]) / MIB
    with pytest.raises(ConfigError) as caught:
        tune_settings(cfg, explicit_keys(args), 2, Budget(smallest - 50, "test"), "cpu")
    message = str(caught.value)
    assert "\n" not in message and f"smallest reachable peak is {smallest:,.0f} MiB" in message
    assert "it fits with 4 ranks" in message  # 8GF's state halves on twice the ranks
    with pytest.raises(ConfigError, match="no single lever"):
        tune_settings(cfg, explicit_keys(args), 2, Budget(1, "test"), "cpu")


def test_a_resumed_run_keeps_its_knobs_while_they_fit(tmp_path, monkeypatch, fixed_baseline):
    args = [*SHARDED, f"config.CHECKPOINT.DIR={tmp_path}"]
    cfg = load_config(args)
    recorded = with_knobs(cfg, {"wrap_granularity": "block", "reshard_after_forward": True})
    (tmp_path / "config.yaml").write_text(recorded.dump())
    monkeypatch.setattr("vistrain.checkpoint.find_latest_checkpoint", lambda run_dir: str(tmp_path / "ckpt"))
    result = tune_settings(cfg, explicit_keys(args), 2, Budget(1e6, "test"), "cpu")
    tuned, line = result.cfg, result.line
    assert line.startswith("auto-tune: kept the resumed run's")
    assert (tuned.MODEL.FSDP_CONFIG.wrap_granularity, tuned.MODEL.FSDP_CONFIG.reshard_after_forward) == (
        "block",
        True,
    )
    # a budget the recorded setting no longer fits: chosen again, and said why
    kept_peak = plan(run_shape(cfg).with_knobs(auto_tune.exact_knobs_of(recorded))).peak / MIB
    smallest = min(planned_settings(run_shape(cfg), "cpu")[1]) / MIB
    assert smallest < kept_peak
    result = tune_settings(cfg, explicit_keys(args), 2, Budget((smallest + kept_peak) / 2, "test"), "cpu")
    tuned, line = result.cfg, result.line
    assert "no longer fits" in line and tuned.MODEL.FSDP_CONFIG.wrap_granularity is not None


def test_a_resumed_shard_group_size_that_does_not_divide_the_new_world_is_chosen_again(
    tmp_path, monkeypatch, fixed_baseline
):
    """A run tuned to shard_group_size=2 on 4 ranks, resumed on 3: k=2 cannot split 3 ranks, so
    it is chosen again (one note in the line); the other resumed knobs are kept."""
    args = [*SHARDED, f"config.CHECKPOINT.DIR={tmp_path}"]
    cfg = load_config(args)
    recorded = with_knobs(cfg, {"shard_group_size": 2, "wrap_granularity": "block"})
    (tmp_path / "config.yaml").write_text(recorded.dump())
    monkeypatch.setattr("vistrain.checkpoint.find_latest_checkpoint", lambda run_dir: str(tmp_path / "ckpt"))
    result = tune_settings(cfg, explicit_keys(args), 3, Budget(1e6, "test"), "cpu")
    fsdp = result.cfg.MODEL.FSDP_CONFIG
    assert fsdp.shard_group_size in (0, 1, 3) and fsdp.wrap_granularity == "block"
    assert "shard_group_size=2 does not divide 3 ranks: chose shard_group_size=" in result.line
    assert "\n" not in result.line
    result = tune_settings(cfg, explicit_keys(args), 4, Budget(1e6, "test"), "cpu")  # 4 ranks: kept
    assert result.cfg.MODEL.FSDP_CONFIG.shard_group_size == 2 and "does not divide" not in result.line


def test_ranks_that_chose_differently_stop_with_one_line():
    same = {"wrap_granularity": "model"}
    auto_tune.check_same_knobs([same, dict(same)])
    with pytest.raises(ConfigError, match="MEMORY_BUDGET_MIB to the same value"):
        auto_tune.check_same_knobs([same, {"wrap_granularity": "block"}])


def test_the_speed_order_puts_fewer_collectives_and_no_recomputation_first():
    cost = {
        k: speed_cost(dict(wrap_granularity=k[0], reshard_after_forward=k[1]), "cpu")
        for k in planner_knobs.STEP_VS_DDP
    }
    assert cost[("model", False)] < cost[("stage", False)] < cost[("block", False)] < cost[("block", True)]
    plain = _setting("block", True)
    assert speed_cost(plain, "cpu") < speed_cost({**plain, "activation_checkpointing": True}, "cpu")
    assert speed_cost({"activation_checkpointing": False}, "cpu") == 1.0  # DDP, the reference
    assert speed_cost(plain, "cpu") < speed_cost({**plain, "cpu_mmap_threshold_mib": 1.0}, "cpu")


# --------------------------------------------------------------------------------------------
# shard_group_size: replication on one node, the ranks' choice across nodes

NODES = [*SHARDED, "config.DISTRIBUTED.NUM_NODES=2", "config.DISTRIBUTED.NUM_PROC_PER_NODE=2"]


def test_shard_group_sizes_planned_one_node_and_across_nodes(fixed_baseline):
    one_node = {k["shard_group_size"] for k in exact_settings(run_shape(load_config(SHARDED)), "cpu")}
    assert one_node == {0, 1}  # all ranks, or each rank everything
    assert {k["shard_group_size"] for k in exact_settings(run_shape(load_config(NODES)), "cpu")} == {0, 2, 1}
    args = [*SHARDED, "config.MODEL.FSDP_CONFIG.shard_group_size=0"]
    kept = tune_settings(load_config(args), explicit_keys(args), 2, Budget(1e6, "test"), "cpu")
    assert kept.cfg.MODEL.FSDP_CONFIG.shard_group_size == 0 and "shard_group_size" in kept.line  # kept as set
    tuned = tune_settings(load_config(NODES), explicit_keys(NODES), 4, Budget(1e6, "test"), "cpu")
    assert [
        knobs["shard_group_size"] for knobs, _ in tuned.across_nodes
    ] and not tuned.cfg.MODEL.FSDP_CONFIG.AUTO_TUNE
    assert sorted(knobs["shard_group_size"] for knobs, _ in tuned.across_nodes) == [0, 1, 2]
    assert "The ranks choose by the link's speed" in tuned.line
    assert tuned.layout == {"DISTRIBUTED.NUM_NODES": 2, "ranks": 4}
    # per shard group size its fastest fitting setting, fastest first; none where nothing fits
    settings = [
        {**_setting("model", False), "shard_group_size": 1},
        {**_setting("model", False), "shard_group_size": 2},
        {**_setting("block", True), "shard_group_size": 2},
        {**_setting("block", True), "shard_group_size": 0},
    ]
    best = auto_tune._per_shard_group(settings, [900, 700, 400, 300], 800, "cpu")
    assert best == [(settings[1], 700), (settings[3], 300)]


def _choose_on_ranks(rank, world, gbps):
    """Every rank tunes as its node's launcher did, then the ranks choose (rank 0 decides)."""
    planner_memory.import_baseline_mib = lambda forked=False: 700.0
    args = [*NODES, f"config.MACHINE.INTER_NODE_GBPS={gbps}"]
    tuned = tune_settings(load_config(args), explicit_keys(args), world, Budget(1e6, "test"), "cpu")
    chosen, line = choose_across_nodes(tuned.cfg, tuned.across_nodes, tuned.layout, torch.device("cpu"))
    return chosen.MODEL.FSDP_CONFIG.shard_group_size, line


def test_ranks_across_nodes_agree_and_a_slow_link_picks_a_shard_group_per_node():
    slow = run_on_ranks(_choose_on_ranks, 4, 0.001)  # 1 Mbit/s: the link's bytes decide
    assert {k for k, _ in slow} == {2} and len({line for _, line in slow}) == 1
    assert "link 0.001 Gbit/s (MACHINE.INTER_NODE_GBPS)" in slow[0][1]
    measured = run_on_ranks(_choose_on_ranks, 4, 0.0)  # measured between the "nodes" (loopback)
    assert len(set(measured)) == 1 and "(measured)" in measured[0][1]


# --------------------------------------------------------------------------------------------
# real runs through tools/run_distributed.py

# big enough that the settings' planned peaks lie tens of MiB apart (the run's import baseline is
# the launcher's RSS, about 10 MiB off the test's subprocess measurement); 2 iterations per epoch
REAL = [
    *SHARDED,
    "config.MODEL.FSDP_CONFIG.AUTO_TUNE=True",
    "config.MODEL.TRUNK.REGNET.NAME=regnet_y_1_6gf",
    "config.MODEL.HEAD.DIMS=[888,64,16]",
    "config.DATA.TRAIN.IMAGE_SIZE=48",
    "config.DATA.TRAIN.TRANSFORMS.SIZE_CROPS=[48]",
    "config.DATA.TRAIN.BATCHSIZE_PER_REPLICA=8",
    "config.DATA.TRAIN.SYNTHETIC_SIZE=32",
    "config.OPTIMIZER.num_epochs=1",
    "config.LOG_FREQUENCY=1",
]


def _train(rank, world_size, cfg):
    train(cfg)


@pytest.fixture(scope="module")
def launcher():
    """The command line's launcher, each job in a fork of one fresh interpreter (one torch
    start-up for the module's jobs; its RSS, the auto-tuner's baseline, is a fresh launcher's)."""
    with FreshLauncher() as fresh:
        yield fresh


def _run(launcher, folder: Path, *args):
    """(exit code, stdout, stderr) of the command line's ``args``; its output in ``folder``."""
    n = len(list(folder.glob("job*.out")))
    out, err = folder / f"job{n}.out", folder / f"job{n}.err"
    code = launcher.run(args, out, err)
    return code, out.read_text(), err.read_text()


def _losses(run_dir: Path):
    return [json.loads(line)["loss"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _zero3_with_checkpointing(knobs):
    return (
        knobs["reshard_after_forward"]
        and knobs["activation_checkpointing"]
        and knobs["wrap_granularity"] != "model"
    )


def _small_budget_mib(args):
    """A budget that only ZeRO-3 settings with activation checkpointing fit, by a margin on both
    sides ("model" keeps its one unit gathered: ZeRO-2 whatever reshard says)."""
    settings, peaks = planned_settings(run_shape(load_config(args)), "cpu")
    forced = min(p for k, p in zip(settings, peaks) if _zero3_with_checkpointing(k)) / MIB
    others = min(p for k, p in zip(settings, peaks) if not _zero3_with_checkpointing(k)) / MIB
    assert others - forced > 30, (forced, others)
    return (forced + others) / 2


def test_small_budget_forces_zero3_with_checkpointing_large_one_zero2_same_losses_and_resume(
    tmp_path, launcher
):
    head = (ROOT / "configs" / "test" / "simclr_tiny.yaml").read_text()
    assert "AUTO_TUNE" not in head  # the test sets it itself
    small, large = tmp_path / "small", tmp_path / "large"
    budget = _small_budget_mib([*REAL, f"config.CHECKPOINT.DIR={small}"])
    code, out, err = _run(
        launcher,
        tmp_path,
        *REAL,
        f"config.CHECKPOINT.DIR={small}",
        f"config.MACHINE.MEMORY_BUDGET_MIB={budget}",
    )
    assert code == 0, err[-2000:]
    chosen = yaml.safe_load((small / "config.yaml").read_text())
    assert chosen["MODEL"]["FSDP_CONFIG"]["reshard_after_forward"] is True
    assert chosen["MODEL"]["ACTIVATION_CHECKPOINTING"]["USE_ACTIVATION_CHECKPOINTING"] is True
    # the console: one short line; log.txt: the planned peaks and the budget
    assert len(re.findall(r"auto-tune: .* \(details in log.txt\)", out)) == 1
    assert (
        len(
            re.findall(
                r"auto-tune: chose .* planned .* MiB per rank, budget", (small / "log.txt").read_text()
            )
        )
        == 1
    )
    # the large budget: the launcher's own choice (tune_job) in this process, trained on forked
    # ranks (a second launcher start-up would add half a minute; the launcher's path is the
    # small run's and the resume's)
    args = [*REAL, f"config.CHECKPOINT.DIR={large}", "config.MACHINE.MEMORY_BUDGET_MIB=100000"]
    tuned = tune_job(load_config(args), args).cfg
    run_on_ranks(_train, 2, tuned)
    wide = yaml.safe_load((large / "config.yaml").read_text())
    assert wide["MODEL"]["FSDP_CONFIG"]["reshard_after_forward"] is False
    assert wide["MODEL"]["ACTIVATION_CHECKPOINTING"]["USE_ACTIVATION_CHECKPOINTING"] is False
    assert _losses(small) == pytest.approx(_losses(large), rel=1e-5, abs=1e-6)
    # resume the small-budget run with a large budget: its knobs still fit and are kept
    code, out, err = _run(
        launcher,
        tmp_path,
        *REAL,
        f"config.CHECKPOINT.DIR={small}",
        "config.OPTIMIZER.num_epochs=2",
        "config.CHECKPOINT.ALLOW_OTHER_SCHEDULE=True",  # trains on from the 1-epoch run
        "config.MACHINE.MEMORY_BUDGET_MIB=100000",
    )
    assert code == 0, err[-2000:]
    assert "auto-tune: kept the resumed run's" in out
    resumed = yaml.safe_load((small / "config.yaml").read_text())
    assert resumed["MODEL"]["FSDP_CONFIG"] == chosen["MODEL"]["FSDP_CONFIG"]
    assert resumed["MODEL"]["ACTIVATION_CHECKPOINTING"] == chosen["MODEL"]["ACTIVATION_CHECKPOINTING"]


def test_refusal_exits_2_with_one_line_and_writes_nothing(tmp_path, launcher):
    run_dir = tmp_path / "run"
    tuned = [*SHARDED, "config.MODEL.FSDP_CONFIG.AUTO_TUNE=True"]
    code, out, err = _run(
        launcher, tmp_path, *tuned, f"config.CHECKPOINT.DIR={run_dir}", "config.MACHINE.MEMORY_BUDGET_MIB=1"
    )
    assert code == 2
    assert err.strip().count("\n") == 0 and err.startswith(
        "config error: MODEL.FSDP_CONFIG.AUTO_TUNE: nothing fits"
    )
    assert not run_dir.exists()
