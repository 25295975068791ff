"""The optimizer step inside backward equals the ordinary ``optimizer.step()`` path: weights and
optimizer state after several steps, for every optimizer and setting the trainer uses; the
gradients alive during backward stay within two units' shards."""

import contextlib
import functools
import json
import shutil
from pathlib import Path

import pytest
import torch
from torch import nn

from vistrain.checkpoint import consolidated_state_dict
from vistrain.distributed.testing import run_on_ranks
from vistrain.fsdp import apply_optimizer_in_backward, auto_wrap, by_class
from vistrain.fsdp.memory import storage_bytes
from vistrain.methods import get_defaults, load_config
from vistrain.optim import build_lr_schedule, build_optimizer, param_group_key, set_lr
from vistrain.training.trainer import train

STEPS = 4


class Model(nn.Module):
    """trunk: conv -> BN -> conv; head: linear -> BN1d -> linear (no decay on BN and biases, the
    head at its own lr)."""

    def __init__(self):
        super().__init__()
        self.trunk = nn.Sequential(
            nn.Conv2d(3, 6, 3), nn.BatchNorm2d(6), nn.ReLU(), nn.Conv2d(6, 5, 3), nn.AdaptiveAvgPool2d(1)
        )
        self.head = nn.Sequential(
            nn.Flatten(), nn.Linear(5, 7), nn.BatchNorm1d(7), nn.Linear(7, 3, bias=False)
        )

    def forward(self, x):
        return self.head(self.trunk(x))


OPTIMIZERS = {
    "sgd": dict(name="sgd", momentum=0.9, weight_decay=1e-3),
    "sgd_nesterov": dict(name="sgd", momentum=0.9, nesterov=True, weight_decay=1e-3),
    "lars": dict(name="lars", momentum=0.9, weight_decay=1e-3, lars_eta=0.02, regularize_bn=True),
    "adamw": dict(name="adamw", weight_decay=0.05),
}


def _opt_cfg(name):
    cfg = get_defaults().OPTIMIZER
    for key, value in {**OPTIMIZERS[name], "head_lr_multiplier": 2.0, "num_epochs": 2}.items():
        cfg[key] = value
    cfg.param_schedulers.lr.base_value = 0.01 if name == "adamw" else 0.05
    cfg.param_schedulers.lr.warmup_epochs = 0.5  # warm-up, then cosine
    return cfg


def _batch(step, micro, rank):
    gen = torch.Generator().manual_seed(100 * step + 10 * micro + rank)
    return torch.randn(4, 3, 7, 7, generator=gen), torch.randint(0, 3, (4,), generator=gen)


def _train(model, optimizer, cfg, rank, in_backward, update_freq, reshard_units):
    schedule = build_lr_schedule(cfg, iterations_per_epoch=STEPS // 2)
    for step in range(STEPS):
        set_lr(optimizer, schedule(step))
        for micro in range(update_freq):
            sync = micro + 1 == update_freq
            with contextlib.nullcontext() if sync else model.no_sync():
                x, y = _batch(step, micro, rank)
                (nn.functional.cross_entropy(model(x), y) / update_freq).backward()
        if not in_backward:
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    return model


def _wrapped(cfg, reshard):
    torch.manual_seed(0)
    group_fn = functools.partial(param_group_key, opt_cfg=cfg)
    return auto_wrap(
        Model(), by_class([nn.Linear, nn.Conv2d]), param_group_fn=group_fn, reshard_after_forward=reshard
    )


def _parity_worker(rank, world, opt_name, reshard, update_freq):
    cfg = _opt_cfg(opt_name)
    out = []
    for in_backward in (False, True):
        model = _wrapped(cfg, reshard)
        optimizer = build_optimizer(cfg, model)
        if in_backward:
            apply_optimizer_in_backward(model, optimizer)
        _train(model, optimizer, cfg, rank, in_backward, update_freq, reshard)
        states = [optimizer.state[p] for p in model.parameters()]
        grads_left = sum(p.grad is not None for p in model.parameters())
        out.append((model.state_dict(), states, grads_left))
    (ref_weights, ref_states, _), (weights, states, grads_left) = out
    weight_diff = max((weights[k] - ref_weights[k]).abs().max().item() for k in ref_weights)
    state_diff = max(
        (a[key].float() - b[key].float()).abs().max().item()
        for a, b in zip(states, ref_states)
        for key in b
        if b[key].numel()  # a parameter this rank holds no element of has empty state
    )
    same_keys = all(sorted(a) == sorted(b) and b for a, b in zip(states, ref_states))
    return weight_diff, state_diff, same_keys, grads_left


@pytest.mark.parametrize("opt_name", sorted(OPTIMIZERS))
@pytest.mark.parametrize("world", [1, 2, 3])
def test_step_in_backward_equals_the_ordinary_step(world, opt_name):
    for weight_diff, state_diff, same_keys, grads_left in run_on_ranks(
        _parity_worker, world, opt_name, True, 1
    ):
        assert weight_diff < 1e-6 and state_diff < 1e-6, (weight_diff, state_diff)
        assert same_keys and grads_left == 0


@pytest.mark.parametrize("opt_name", ["lars", "adamw"])
def test_step_in_backward_with_zero2_and_accumulation(opt_name):
    for reshard, update_freq in ((False, 1), (True, 3)):
        for weight_diff, state_diff, same_keys, grads_left in run_on_ranks(
            _parity_worker, 2, opt_name, reshard, update_freq
        ):
            assert weight_diff < 1e-6 and state_diff < 1e-6, (reshard, update_freq, weight_diff, state_diff)
            assert same_keys and grads_left == 0


# -- memory: gradients alive during backward -----------------------------------------------------
def _grad_bytes_worker(rank, world):
    cfg = _opt_cfg("sgd")
    model = _wrapped(cfg, True)
    optimizer = build_optimizer(cfg, model)
    apply_optimizer_in_backward(model, optimizer)
    shards = list(model.parameters())
    seen = []

    def measure(*_):  # inside backward, just before each shard's update
        seen.append(storage_bytes(p.grad for p in shards if p.grad is not None))

    optimizer.register_step_pre_hook(measure)
    _train(model, optimizer, cfg, rank, True, 1, True)
    unit_bytes = sorted(
        (sum(h.shard.untyped_storage().nbytes() for h in u.handles) for u in model.model_state.units),
        reverse=True,
    )
    whole = sum(p.untyped_storage().nbytes() for p in shards)
    return max(seen), sum(unit_bytes[:2]), whole


@pytest.mark.parametrize("world", [2, 3])
def test_gradients_alive_in_backward_stay_within_two_units(world):
    for most, two_largest, whole in run_on_ranks(_grad_bytes_worker, world):
        assert 0 < most <= two_largest < whole, (most, two_largest, whole)


# -- the training loop: SwAV's frozen and normalised prototypes, LARS, resume flipped -----------
def _train_on_rank(rank, world_size, argv):
    train(load_config(argv))
    return rank


def _swav_sharded(run_dir, *overrides):
    return [
        "config=test/swav_tiny",
        f"config.CHECKPOINT.DIR={run_dir}",
        "config.MODEL.FSDP_CONFIG.AUTO_SETUP_FSDP=True",
        "config.OPTIMIZER.name=lars",
        "config.OPTIMIZER.head_lr_multiplier=2.0",
        *overrides,
    ]


def _losses(run_dir):
    return [json.loads(line)["loss"] for line in Path(run_dir, "metrics.jsonl").read_text().splitlines()]


def test_swav_with_lars_trains_the_same_with_the_step_in_backward(tmp_path):
    """Frozen prototypes for 2 iterations, normalised after every step, the queue, LARS with its
    exclusions, head lr multiplier, warm-up: the same losses and weights."""
    ordinary, in_backward = tmp_path / "ordinary", tmp_path / "in_backward"
    run_on_ranks(_train_on_rank, 2, _swav_sharded(ordinary))
    run_on_ranks(_train_on_rank, 2, _swav_sharded(in_backward, "config.OPTIMIZER.step_in_backward=True"))
    torch.testing.assert_close(_losses(in_backward), _losses(ordinary), rtol=1e-5, atol=0)
    ref, got = (
        consolidated_state_dict(str(ordinary / "checkpoint_8")),
        consolidated_state_dict(str(in_backward / "checkpoint_8")),
    )
    for key in ref:
        torch.testing.assert_close(got[key], ref[key], rtol=1e-5, atol=1e-6, msg=key)


def test_a_run_resumes_with_the_step_in_backward_switched_on_or_off(tmp_path):
    """SGD is element-wise, so the two paths agree bit for bit, and a checkpoint of either one
    continues under the other to the same weights."""
    sgd, on = "config.OPTIMIZER.name=sgd", "config.OPTIMIZER.step_in_backward=True"
    runs = {"off": [sgd], "on": [sgd, on]}
    for name, overrides in runs.items():
        run_on_ranks(_train_on_rank, 2, _swav_sharded(tmp_path / name, *overrides))
    for saved_by, resumed_with in (("off", "on"), ("on", "off")):
        folder = tmp_path / f"{saved_by}_then_{resumed_with}"
        shutil.copytree(tmp_path / saved_by / "checkpoint_4", folder / "checkpoint_4")  # after epoch 1
        run_on_ranks(_train_on_rank, 2, _swav_sharded(folder, *runs[resumed_with]))
    ref = consolidated_state_dict(str(tmp_path / "off" / "checkpoint_8"))
    for name in ("on", "off_then_on", "on_then_off"):
        got = consolidated_state_dict(str(tmp_path / name / "checkpoint_8"))
        for key in ref:
            torch.testing.assert_close(got[key], ref[key], rtol=0, atol=0, msg=f"{name}: {key}")


def test_binding_a_model_the_engine_did_not_wrap_is_an_error():
    plain = nn.Linear(2, 2)
    with pytest.raises(
        TypeError, match="needs the root FullyShardedDataParallel of the model \\(got Linear\\)"
    ):
        apply_optimizer_in_backward(plain, torch.optim.SGD(plain.parameters(), lr=0.1))
