"""The training loop in fp16 on CPU ranks (loss scaling under the engine and DDP, its log and its
resume) and a backward that fails after the step in backward updated some units.

One spawn of 2 gloo ranks runs every training (``_runs``); the tests read their metrics.
"""

import json
import shutil
from pathlib import Path

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from torch import nn

import vistrain.runtime.precision as precision_module
import vistrain.training.trainer as trainer_module
from vistrain.config import InputError
from vistrain.distributed.testing import run_on_ranks
from vistrain.methods import load_config

FP16 = ["config.MODEL.AMP_PARAMS.USE_AMP=True", "config.MODEL.AMP_PARAMS.AMP_DTYPE=float16"]
DDP = ["config.MODEL.FSDP_CONFIG.AUTO_SETUP_FSDP=False"]
# 2^40 overflows; a backoff of 2^-10 reaches a working scale (2^10) after three skipped steps
HUGE_SCALE = [
    "config.MODEL.AMP_PARAMS.INIT_SCALE=1099511627776.0",
    "config.MODEL.AMP_PARAMS.BACKOFF_FACTOR=0.0009765625",
]
GROWING = ["config.MODEL.AMP_PARAMS.GROWTH_INTERVAL=2"]  # the scale grows again: a scaler state to resume


def _quick_start(run_dir, *overrides):
    """The quick start (regnet_fsdp) on 2 x 16 images per step, 3 steps per epoch, 2 epochs."""
    return [
        "config=regnet_fsdp",
        f"config.CHECKPOINT.DIR={run_dir}",
        "config.DATA.TRAIN.DATA_LIMIT=96",
        "config.DATA.TRAIN.BATCHSIZE_PER_REPLICA=16",
        "config.OPTIMIZER.num_epochs=2",
        "config.LOG_FREQUENCY=1",
        "config.MONITOR.EVERY_EPOCHS=0",  # the training's records only
        *overrides,
    ]


def _runs(base: Path) -> dict:
    return {
        "fp32": _quick_start(base / "fp32"),
        "engine": _quick_start(base / "engine", *FP16),
        "ddp": _quick_start(base / "ddp", *FP16, *DDP),
        "engine_huge": _quick_start(base / "engine_huge", *FP16, *HUGE_SCALE, *GROWING),
        "ddp_huge": _quick_start(base / "ddp_huge", *FP16, *DDP, *HUGE_SCALE, *GROWING),
    }


class _FailingBackward:
    """A tensor hook on the stem's output that raises in the backward of the second step: the
    head and trunk units have stepped in backward by then, the stem's own unit has not."""

    def __init__(self):
        self.calls = 0

    def install(self, model: nn.Module) -> nn.Module:
        stem = next(m for m in model.modules() if isinstance(m, nn.Conv2d))
        stem.register_forward_hook(self.hook_output)
        return model

    def hook_output(self, module, args, out) -> None:
        out.register_hook(self.backward)

    def backward(self, grad):
        self.calls += 1
        if self.calls == 2:
            raise FloatingPointError("injected failure")
        return grad


def _partial_update(rank, run_dir):
    failing = _FailingBackward()
    parallelize = trainer_module.parallelize
    trainer_module.parallelize = lambda *args, **kwargs: failing.install(parallelize(*args, **kwargs))
    argv = [
        "config=test/simclr_tiny",
        f"config.CHECKPOINT.DIR={run_dir}",
        "config.MODEL.FSDP_CONFIG.AUTO_SETUP_FSDP=True",
        "config.OPTIMIZER.step_in_backward=True",
        "config.CHECKPOINT.CHECKPOINT_ITER_FREQUENCY=1",
    ]
    try:
        trainer_module.train(load_config(argv))
    except InputError as error:
        return error.line()
    except Exception as error:
        return f"not an InputError: {error!r}"
    finally:
        trainer_module.parallelize = parallelize
    return None


def _worker(rank, world, base: Path):
    skips = []  # per step on this rank: whether the scaler skipped it
    step = precision_module.LossScaling.step

    def recording_step(self, optimizer):
        before = self.skipped_steps
        step(self, optimizer)
        skips[-1].append(self.skipped_steps > before)

    precision_module.LossScaling.step = recording_step
    for argv in _runs(base).values():
        skips.append([])
        trainer_module.train(load_config(argv))
    precision_module.LossScaling.step = step
    # resume the growing-scale run after its first epoch, as a run killed there and restarted
    resumed = base / "engine_resumed"
    if rank == 0:
        shutil.copytree(base / "engine_huge" / "checkpoint_3", resumed / "checkpoint_3")
    torch.distributed.barrier()
    trainer_module.train(load_config(_quick_start(resumed, *FP16, *HUGE_SCALE, *GROWING)))
    return dict(zip(_runs(base), skips)), _partial_update(rank, base / "partial")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    base = tmp_path_factory.mktemp("fp16")
    return base, run_on_ranks(_worker, 2, base)


def _metrics(run_dir: Path) -> list:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _column(run_dir: Path, key: str) -> list:
    return [row[key] for row in _metrics(run_dir)]


def test_fp16_quick_start_engine_equals_ddp_and_follows_fp32(runs):
    """fp16 autocast with loss scaling on CPU: the engine's losses and scales equal DDP's with
    torch's GradScaler("cpu"). At 65536 the stem's fp16 weight gradients overflow until the scale
    is 2048 or less: those first steps are skipped, as they would be on a GPU, while fp32 moves
    (iteration 2 is the first after a step, at lr 0: the same weights, so fp16's forward alone
    sets the difference)."""
    base, _ = runs
    engine, ddp, fp32 = (
        _column(base / "engine", "loss"),
        _column(base / "ddp", "loss"),
        _column(base / "fp32", "loss"),
    )
    torch.testing.assert_close(engine, ddp, rtol=2e-3, atol=0)
    torch.testing.assert_close(engine[:2], fp32[:2], rtol=5e-2, atol=0)
    assert _column(base / "engine", "loss_scale") == _column(base / "ddp", "loss_scale")
    assert _column(base / "engine", "skipped_steps") == _column(base / "ddp", "skipped_steps")
    assert _column(base / "engine", "loss_scale")[0] == 32768.0  # 65536 overflowed once
    assert "loss_scale" not in _metrics(base / "fp32")[0]


def test_a_huge_initial_scale_skips_the_same_steps_on_every_rank_then_trains(runs):
    _, per_rank = runs
    for skips, _ in per_rank:
        assert skips["engine_huge"] == skips["ddp_huge"] == [True, True, True, False, False, False], skips
    base, _ = runs
    assert _column(base / "engine_huge", "skipped_steps") == [1, 2, 3, 3, 3, 3]
    # 2^40 -> 2^30 -> 2^20 -> 2^10, then two good steps double it (GROWTH_INTERVAL=2)
    assert _column(base / "engine_huge", "loss_scale") == [
        2.0**30,
        2.0**20,
        2.0**10,
        2.0**10,
        2.0**11,
        2.0**11,
    ]
    engine, ddp = _column(base / "engine_huge", "loss"), _column(base / "ddp_huge", "loss")
    torch.testing.assert_close(engine, ddp, rtol=2e-3, atol=0)
    assert engine[4] != engine[3]  # trains once the scale fits


def test_the_scale_is_logged_and_resumed_exactly(runs):
    """log line, metrics.jsonl and TensorBoard show the scale and the skipped steps; a run
    restarted from the first epoch's checkpoint continues with the same scale, growth tracker
    and count of skipped steps: the same records as the uninterrupted run."""
    base, _ = runs
    whole, resumed = _metrics(base / "engine_huge"), _metrics(base / "engine_resumed")
    assert [r["iteration"] for r in resumed] == [4, 5, 6]
    for key in ("loss", "loss_scale", "skipped_steps", "lr"):
        assert [r[key] for r in resumed] == [r[key] for r in whole[3:]], key
    log = (base / "engine_huge" / "log.txt").read_text()
    assert "scale 1024 (3 steps skipped)" in log, log
    events = EventAccumulator(str(base / "engine_huge" / "tb"))
    events.Reload()
    assert [e.value for e in events.Scalars("train/skipped_steps")] == [1, 2, 3, 3, 3, 3]
    assert events.Scalars("train/loss_scale")[-1].value == 2.0**11


def test_a_backward_failing_after_units_stepped_stops_training_in_one_line(runs):
    base, per_rank = runs
    for _, line in per_rank:
        assert line is not None and "\n" not in line, line
        assert line.startswith("training stopped: the backward of iteration 2 failed (FloatingPointError"), (
            line
        )
        assert "the weights are partly updated and were not saved" in line, line
        assert f"rerun the same command to resume from {base / 'partial' / 'checkpoint_1'}" in line, line
