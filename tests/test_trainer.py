"""Training loop, checkpoints and the end-to-end CLI run on the tiny recipes in configs/test/.

Multi-rank runs call ``train`` on real gloo processes (``run_on_ranks``); one test goes through
``tools/run_distributed.py`` (spawned ranks) and checks what a user sees: metrics, TensorBoard,
config.yaml, checkpoints, auto-resume.
"""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from vistrain.checkpoint import (
    consolidated_state_dict,
    find_latest_checkpoint,
    load_sharded_checkpoint,
    read_metadata,
    save_sharded_checkpoint,
)
from vistrain.data import build_loader, set_epoch
from vistrain.distributed.testing import run_on_ranks
from vistrain.methods import build_loss, build_model, load_config
from vistrain.optim import build_optimizer
from vistrain.training.trainer import StepSettings, _accumulation_group, _forward_backward, _Group, train

REPO = Path(__file__).resolve().parents[1]


def _train_on_rank(rank, world_size, argv):
    train(load_config(argv))
    return rank


def _metrics(run_dir) -> list:
    return [json.loads(line) for line in Path(run_dir, "metrics.jsonl").read_text().splitlines()]


def _weights(checkpoint_dir) -> dict:
    return consolidated_state_dict(str(checkpoint_dir))


def _tiny(run_dir, *overrides):
    return ["config=test/simclr_tiny", f"config.CHECKPOINT.DIR={run_dir}", *overrides]


# --------------------------------------------------------------------------------------------
# distributed training equals single-process training


@pytest.mark.parametrize("channels_last", [False, True])
def test_two_ranks_with_sync_bn_equal_one_rank_with_the_global_batch(tmp_path, channels_last):
    """2 ranks x 4 images (sync BN, global SimCLR negatives, DDP mean) == 1 rank x 8 images; the
    two ranks also with their batches in channels_last memory (the one rank: contiguous). At the
    parity lr, 0.02: at the tiny recipe's 0.05 rounding differences grow past any tolerance on
    some seeds (seeds 0-3: up to 626x it with channels_last, 1.4x without; at 0.02 within 0.23x)."""
    common = [
        "config.LOG_FREQUENCY=1",
        "config.MODEL.SYNC_BN_CONFIG.CONVERT_BN_TO_SYNC_BN=true",
        "config.OPTIMIZER.param_schedulers.lr.base_value=0.02",
    ]
    layout = [f"config.MODEL.CHANNELS_LAST={channels_last}"]
    run_on_ranks(_train_on_rank, 2, _tiny(tmp_path / "two", *common, *layout))
    run_on_ranks(
        _train_on_rank, 1, _tiny(tmp_path / "one", *common, "config.DATA.TRAIN.BATCHSIZE_PER_REPLICA=8")
    )
    two, one = _metrics(tmp_path / "two"), _metrics(tmp_path / "one")
    assert [m["iteration"] for m in two] == list(range(1, 9))
    torch.testing.assert_close([m["loss"] for m in two], [m["loss"] for m in one], rtol=1e-4, atol=1e-5)
    assert [m["lr"] for m in two] == [m["lr"] for m in one]
    final_two, final_one = (
        _weights(tmp_path / "two" / "checkpoint_8"),
        _weights(tmp_path / "one" / "checkpoint_8"),
    )
    assert final_two.keys() == final_one.keys()
    for key in final_one:
        torch.testing.assert_close(final_two[key], final_one[key], rtol=1e-4, atol=1e-5, msg=key)


def test_channels_last_batches_reach_the_model():
    seen = []

    class Recorder(nn.Module):
        def __init__(self):
            super().__init__()
            self.scale = nn.Parameter(torch.ones(()))

        def forward(self, crops):
            seen.extend(c.is_contiguous(memory_format=torch.channels_last) for c in crops)
            return sum(c.sum() for c in crops) * self.scale

    class Loss:
        def student_crops(self, crops):
            return crops

        def masking(self, crops):
            return {}

        def __call__(self, out, num_crops, targets):
            return out

    crops = [torch.rand(2, 3, 8, 8), torch.rand(2, 3, 6, 6)]
    for memory_format, expected in ((torch.contiguous_format, False), (torch.channels_last, True)):
        seen.clear()
        settings = StepSettings(torch.device("cpu"), None, None, 1, 0.0, None, memory_format)
        _forward_backward(Recorder(), Loss(), {"crops": crops}, settings, _Group(1, True), ("", 0))
        assert seen == [expected, expected]


def _accumulation_reference(rank, world_size, argv):
    """Plain re-statement of the step: micro-batch losses / group size, one SGD step per group."""
    cfg = load_config(argv)
    torch.manual_seed(cfg.SEED_VALUE)
    loader = build_loader(cfg.DATA, "TRAIN", seed=cfg.SEED_VALUE, device=torch.device("cpu"))
    model, criterion = build_model(cfg.MODEL), build_loss(cfg.LOSS)
    optimizer = build_optimizer(cfg.OPTIMIZER, model)
    set_epoch(loader, 0)
    batches = list(loader)
    for group in (batches[0:2], batches[2:3]):  # 3 iterations, update_freq 2: groups of 2 and 1
        for batch in group:
            (criterion(model(batch["crops"]), 2) / len(group)).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return model.state_dict()


def test_gradient_accumulation_matches_a_plain_reference(tmp_path):
    argv = _tiny(
        tmp_path,
        "config.OPTIMIZER.num_epochs=1",
        "config.OPTIMIZER.update_freq=2",
        "config.DATA.TRAIN.SYNTHETIC_SIZE=12",
        "config.OPTIMIZER.param_schedulers.lr.name=constant",
        "config.OPTIMIZER.param_schedulers.lr.warmup_epochs=0",
    )
    run_on_ranks(_train_on_rank, 1, argv)
    [reference] = run_on_ranks(_accumulation_reference, 1, argv)
    trained = _weights(tmp_path / "checkpoint_3")
    for key in reference:
        torch.testing.assert_close(trained[key], reference[key], rtol=1e-5, atol=1e-6, msg=key)


@pytest.mark.parametrize(
    "iters_per_epoch, update_freq, expected",
    [
        (4, 1, [(1, True)] * 4),
        (4, 2, [(2, False), (2, True)] * 2),
        (5, 2, [(2, False), (2, True), (2, False), (2, True), (1, True)]),
        (3, 4, [(3, False), (3, False), (3, True)]),
    ],
)
def test_accumulation_groups(iters_per_epoch, update_freq, expected):
    got = [_accumulation_group(i, iters_per_epoch, update_freq) for i in range(iters_per_epoch)]
    assert [(g.size, g.is_last) for g in got] == expected


# --------------------------------------------------------------------------------------------
# resume and divergence


def test_resume_mid_epoch_reproduces_the_uninterrupted_run(tmp_path):
    full, resumed = tmp_path / "full", tmp_path / "resumed"
    freq = ["config.CHECKPOINT.CHECKPOINT_ITER_FREQUENCY=2", "config.CHECKPOINT.KEEP_LAST=10"]
    run_on_ranks(_train_on_rank, 2, _tiny(full, *freq))
    assert sorted(os.listdir(full / "checkpoint_2")) == ["metadata.json", "rank0.pt", "rank1.pt"]
    shutil.copytree(full / "checkpoint_2", resumed / "checkpoint_2")  # iteration 2: inside epoch 0
    run_on_ranks(_train_on_rank, 2, _tiny(resumed, *freq))
    assert [m["iteration"] for m in _metrics(resumed)] == [4, 6, 8]  # continued, did not start over
    assert _metrics(resumed)[-1]["loss"] == _metrics(full)[-1]["loss"]
    final_full, final_resumed = _weights(full / "checkpoint_8"), _weights(resumed / "checkpoint_8")
    for key in final_full:
        torch.testing.assert_close(final_resumed[key], final_full[key], rtol=0, atol=0, msg=key)
    # a finished run has nothing left to do; another world size with the same global batch
    # continues at the same position (tests/test_checkpoint.py checks the state itself)
    run_on_ranks(_train_on_rank, 2, _tiny(resumed, *freq))
    assert len(_metrics(resumed)) == 3
    shutil.copytree(full / "checkpoint_2", tmp_path / "one" / "checkpoint_2")
    run_on_ranks(
        _train_on_rank, 1, _tiny(tmp_path / "one", *freq, "config.DATA.TRAIN.BATCHSIZE_PER_REPLICA=8")
    )
    assert [m["iteration"] for m in _metrics(tmp_path / "one")] == [4, 6, 8]


def test_nan_loss_stops_every_rank_with_a_clear_error(tmp_path):
    argv = _tiny(
        tmp_path,
        "config.LOG_FREQUENCY=1",
        "config.OPTIMIZER.param_schedulers.lr.base_value=.nan",
        "config.OPTIMIZER.param_schedulers.lr.warmup_epochs=0",
    )
    with pytest.raises(RuntimeError, match="loss became nan by iteration 2; no checkpoint in .* yet; lower"):
        run_on_ranks(_train_on_rank, 2, argv)
    assert find_latest_checkpoint(str(tmp_path)) is None


def test_nan_weights_are_never_checkpointed(tmp_path):
    argv = _tiny(
        tmp_path,
        "config.LOG_FREQUENCY=100",
        "config.CHECKPOINT.CHECKPOINT_ITER_FREQUENCY=1",
        "config.OPTIMIZER.param_schedulers.lr.base_value=.nan",
        "config.OPTIMIZER.param_schedulers.lr.warmup_epochs=0",
    )
    with pytest.raises(RuntimeError, match="model weights became nan/inf by iteration 1; no checkpoint in"):
        run_on_ranks(_train_on_rank, 2, argv)
    assert find_latest_checkpoint(str(tmp_path)) is None


# --------------------------------------------------------------------------------------------
# checkpoint files (single process: the collectives are no-ops)


def _save(ckpt_dir, iteration, model, optimizer, keep_last=2):
    return save_sharded_checkpoint(
        str(ckpt_dir), iteration, model, optimizer, {"loss": {}}, {"epoch": 0, "note": "x"}, keep_last
    )


def test_checkpoint_round_trip_and_pruning(tmp_path):
    model = nn.Linear(3, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.ones(1, 3)).sum().backward()
    optimizer.step()
    for iteration in (5, 10, 15):
        _save(tmp_path, iteration, model, optimizer)
    assert sorted(os.listdir(tmp_path)) == ["checkpoint_10", "checkpoint_15"]  # KEEP_LAST 2
    os.makedirs(tmp_path / "checkpoint_20")  # a save killed before meta.json: ignored
    latest = find_latest_checkpoint(str(tmp_path))
    assert latest.endswith("checkpoint_15") and read_metadata(latest)["note"] == "x"
    fresh = nn.Linear(3, 2)
    fresh_opt = torch.optim.SGD(fresh.parameters(), lr=0.1, momentum=0.9)
    state = load_sharded_checkpoint(latest, fresh, fresh_opt)
    assert state["metadata"]["iteration"] == 15 and state["extra"]["loss"] == {}
    torch.testing.assert_close(fresh.weight, model.weight)
    momentum = [o.state_dict()["state"][0]["momentum_buffer"] for o in (fresh_opt, optimizer)]
    assert momentum[0].equal(momentum[1])
    assert not list(Path(tmp_path).rglob("*.tmp"))


# --------------------------------------------------------------------------------------------
# the command line, end to end


def test_cli_run_logs_and_resumes(tmp_path):
    """Epoch 1 by train() on 2 ranks; then the CLI (2 spawned ranks) must train on from it to
    epoch 2 (another schedule, asked for), not start over."""
    run_on_ranks(_train_on_rank, 2, _tiny(tmp_path, "config.OPTIMIZER.num_epochs=1"))
    assert find_latest_checkpoint(str(tmp_path)).endswith("checkpoint_4")
    result = subprocess.run(
        [
            sys.executable,
            str(REPO / "tools" / "run_distributed.py"),
            *_tiny(tmp_path, "config.LOG_FREQUENCY=1", "config.CHECKPOINT.ALLOW_OTHER_SCHEDULE=True"),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=REPO,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "resumed from" in result.stdout and "checkpoint_4" in result.stdout
    assert "done in" in result.stdout and "final loss" in result.stdout
    metrics = _metrics(tmp_path)
    assert [m["iteration"] for m in metrics] == [2, 4, 5, 6, 7, 8]  # 2, 4 from epoch 1; then resumed
    assert {"iteration", "epoch", "loss", "lr", "images_per_sec", "peak_mem_mib", "eta_seconds"} <= metrics[
        -1
    ].keys()
    assert [m["epoch"] for m in metrics[2:]] == [1, 1, 1, 1]
    assert list((tmp_path / "tb").glob("events.out.tfevents.*"))
    saved = load_config([f"config={tmp_path / 'config.yaml'}"])
    assert saved == load_config(
        _tiny(tmp_path, "config.LOG_FREQUENCY=1", "config.CHECKPOINT.ALLOW_OTHER_SCHEDULE=True")
    )
    latest = find_latest_checkpoint(str(tmp_path))
    assert latest.endswith("checkpoint_8") and read_metadata(latest)["world_size"] == 2
    assert sorted(p.name for p in tmp_path.glob("checkpoint_*")) == ["checkpoint_4", "checkpoint_8"]


# --------------------------------------------------------------------------------------------
# other recipes and precisions


def test_swav_recipe_trains_and_checkpoints_each_ranks_queue(tmp_path):
    run_on_ranks(
        _train_on_rank,
        2,
        [
            "config=test/swav_tiny",
            f"config.CHECKPOINT.DIR={tmp_path}",
            "config.LOSS.swav_loss.queue_length=8",
        ],
    )
    losses = [m["loss"] for m in _metrics(tmp_path)]
    assert len(losses) == 4 and all(torch.isfinite(torch.tensor(losses)))
    for rank in (0, 1):
        state = torch.load(tmp_path / "checkpoint_8" / f"rank{rank}.pt", weights_only=True)["extra"]
        queue = state["loss"]["loss._extra_state"]["queue"]
        assert queue.shape == (2, 8, 16)  # (crops_for_assign, queue_length, embedding dim), per rank
    assert not torch.equal(
        *(
            torch.load(tmp_path / "checkpoint_8" / f"rank{r}.pt", weights_only=True)["extra"]["loss"][
                "loss._extra_state"
            ]["queue"]
            for r in (0, 1)
        )
    )


def test_bfloat16_autocast_on_cpu(tmp_path):
    argv = [
        "config.LOG_FREQUENCY=1",
        "config.OPTIMIZER.num_epochs=1",
        "config.DATA.TRAIN.BATCHSIZE_PER_REPLICA=8",
    ]
    run_on_ranks(_train_on_rank, 1, _tiny(tmp_path / "fp32", *argv))
    run_on_ranks(_train_on_rank, 1, _tiny(tmp_path / "bf16", *argv, "config.MODEL.AMP_PARAMS.USE_AMP=true"))
    fp32, bf16 = _metrics(tmp_path / "fp32")[0]["loss"], _metrics(tmp_path / "bf16")[0]["loss"]
    assert fp32 != bf16 and abs(fp32 - bf16) < 0.05 * abs(fp32)  # autocast is on, and still close
