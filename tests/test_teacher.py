"""The momentum teacher: the engine's EMA of local shards against a DDP teacher updated tensor by
tensor, layout checks, and checkpoints holding the teacher (resume exactly; 2 -> 3 ranks)."""

import json
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from fsdp_models import local_batch, make_net, make_optimizer, max_rel_diff, wrap
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from vistrain.checkpoint import consolidated_state_dict
from vistrain.distributed.testing import run_on_ranks
from vistrain.fsdp import LayoutMismatchError, ema_update_
from vistrain.losses import cosine_momentum
from vistrain.methods import load_config
from vistrain.training.resume import resume
from vistrain.training.trainer import _build, train

STEPS = 4


def _frozen(model):
    return model.requires_grad_(False)


def _steps(student, teacher, optimizer, rank, world, per_tensor=False):
    for step in range(STEPS):
        x, y = local_batch(step, rank, world)
        nn.functional.cross_entropy(student(x), y).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        m = cosine_momentum(0.9, step, STEPS)
        if per_tensor:  # the textbook update, one parameter at a time
            with torch.no_grad():
                for t, s in zip(teacher.parameters(), student.module.parameters()):
                    t.mul_(m).add_(s, alpha=1 - m)
        else:
            ema_update_(teacher, student, m)


def _ema_worker(rank, world):
    ddp = DDP(make_net())
    ref_teacher = _frozen(make_net(seed=1))
    ema_update_(ref_teacher, ddp, 0.0)
    assert max_rel_diff(ref_teacher.state_dict(), ddp.module.state_dict()) == 0.0
    _steps(ddp, ref_teacher, make_optimizer("sgd", ddp.parameters()), rank, world, per_tensor=True)
    ref = ref_teacher.state_dict()
    diffs = {}
    for nested in (False, True):
        student = wrap(make_net(), nested)
        teacher = wrap(_frozen(make_net(seed=1)), nested)
        ema_update_(teacher, student, 0.0)  # starts as the student
        assert not any(p.requires_grad for p in teacher.parameters())
        _steps(student, teacher, make_optimizer("sgd", student.parameters()), rank, world)
        diffs[nested] = max_rel_diff(teacher.state_dict(), ref)
    # a plain DDP teacher through the same operation (the AUTO_SETUP_FSDP=False path)
    plain = _frozen(make_net(seed=1))
    student = DDP(make_net())
    ema_update_(plain, student, 0.0)
    _steps(student, plain, make_optimizer("sgd", student.parameters()), rank, world)
    diffs["plain"] = max_rel_diff(plain.state_dict(), ref)
    return diffs


def test_sharded_ema_equals_a_ddp_teacher_updated_per_tensor():
    for diffs in run_on_ranks(_ema_worker, 2):
        assert diffs == {False: 0.0, True: 0.0, "plain": 0.0}, diffs


def _mismatch_worker(rank, world):
    student = wrap(make_net(), nested=True)
    errors = []
    for teacher in (wrap(_frozen(make_net()), nested=False), _frozen(make_net())):
        try:
            ema_update_(teacher, student, 0.5)
        except LayoutMismatchError as error:
            errors.append(str(error))
    return errors


def test_differently_wrapped_teacher_is_one_line():
    errors = run_on_ranks(_mismatch_worker, 2)[0]
    assert len(errors) == 2 and all("\n" not in e for e in errors), errors
    assert "sharded units" in errors[0] and "distributed as" in errors[1]
    with pytest.raises(ValueError, match="momentum"):
        ema_update_(make_net(), make_net(), 1.5)


# -- checkpoints with a teacher ------------------------------------------------------------------
def _train_on_rank(rank, world, argv):
    train(load_config(argv))


def _dino(run_dir, *overrides):
    return [
        "config=test/dino_tiny",
        f"config.CHECKPOINT.DIR={run_dir}",
        "config.MODEL.FSDP_CONFIG.AUTO_SETUP_FSDP=True",
        "config.MODEL.SYNC_BN_CONFIG.CONVERT_BN_TO_SYNC_BN=True",
        "config.LOG_FREQUENCY=1",
        "config.CHECKPOINT.CHECKPOINT_ITER_FREQUENCY=2",
        "config.CHECKPOINT.KEEP_LAST=10",
        *overrides,
    ]


def _losses(run_dir):
    return [json.loads(line)["loss"] for line in Path(run_dir, "metrics.jsonl").read_text().splitlines()]


def test_resume_with_a_teacher_reproduces_the_uninterrupted_run(tmp_path):
    """Student, teacher, optimizer and DINO's centre come back exactly (same world size)."""
    full, resumed = tmp_path / "full", tmp_path / "resumed"
    run_on_ranks(_train_on_rank, 2, _dino(full))
    saved = consolidated_state_dict(str(full / "checkpoint_2"))
    assert any(k.startswith("teacher.trunk.") for k in saved) and "head.last_layer.weight" in saved
    shutil.copytree(full / "checkpoint_2", resumed / "checkpoint_2")
    run_on_ranks(_train_on_rank, 2, _dino(resumed))
    assert _losses(resumed) == _losses(full)[2:]
    final_full, final_resumed = (
        consolidated_state_dict(str(full / "checkpoint_8")),
        consolidated_state_dict(str(resumed / "checkpoint_8")),
    )
    assert final_full.keys() == final_resumed.keys()
    for key in final_full:
        torch.testing.assert_close(final_resumed[key], final_full[key], rtol=0, atol=0, msg=key)


def _resumed_state(rank, world, argv):
    cfg = load_config(argv)
    run = _build(cfg, torch.device("cpu"))
    iteration, _ = resume(cfg.CHECKPOINT.DIR, run)
    teacher = run.teacher.model.state_dict()  # collective: the full teacher
    student = run.model.state_dict()
    dist.barrier()
    return iteration, teacher, student, run.criterion.loss.center.clone()


def test_teacher_checkpoint_of_two_ranks_resumes_on_three(tmp_path):
    run_on_ranks(_train_on_rank, 2, _dino(tmp_path / "two"))
    checkpoint = tmp_path / "two" / "checkpoint_4"
    saved = consolidated_state_dict(str(checkpoint))
    shutil.copytree(checkpoint, tmp_path / "three" / "checkpoint_4")
    # 3 x 4 images per step: the 2-rank run's 32 images are one epoch of 2 iterations here
    results = run_on_ranks(_resumed_state, 3, _dino(tmp_path / "three"))
    saved_centre = torch.load(checkpoint / "rank0.pt", weights_only=True)["extra"]["loss"]["loss.center"]
    for iteration, teacher, student, centre in results:
        assert iteration > 0
        for key, value in teacher.items():
            torch.testing.assert_close(value, saved[f"teacher.{key}"], rtol=0, atol=0, msg=key)
        for key, value in student.items():
            torch.testing.assert_close(value, saved[key], rtol=0, atol=0, msg=key)
        torch.testing.assert_close(centre, saved_centre, rtol=0, atol=0)
    assert not torch.equal(saved_centre, torch.zeros_like(saved_centre))  # a centre was learnt


@pytest.mark.parametrize(
    "variant",
    [
        ["config.OPTIMIZER.step_in_backward=True"],  # the EMA follows the step inside backward
        ["config.OPTIMIZER.update_freq=2"],  # one EMA per accumulation group
        [
            "config.MODEL.FSDP_CONFIG.wrap_granularity=model",
            "config.MODEL.FSDP_CONFIG.reshard_after_forward=False",
        ],
    ],
)
def test_dino_variants_sharded_equal_ddp(variant, tmp_path):
    run_on_ranks(_train_on_rank, 2, _dino(tmp_path / "sharded", *variant))
    ddp = [v for v in variant if "FSDP_CONFIG" not in v and "step_in_backward" not in v]
    run_on_ranks(
        _train_on_rank, 2, _dino(tmp_path / "ddp", *ddp, "config.MODEL.FSDP_CONFIG.AUTO_SETUP_FSDP=False")
    )
    torch.testing.assert_close(_losses(tmp_path / "sharded"), _losses(tmp_path / "ddp"), rtol=1e-5, atol=0)
