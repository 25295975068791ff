"""Parameter groups (plain, DDP, sharded), LARS against a hand-written reference, LR schedules."""

import functools
import math

import pytest
import torch
from torch import nn

from vistrain import cli
from vistrain.distributed.testing import run_on_ranks
from vistrain.fsdp import SegmentValues
from vistrain.methods import get_defaults, load_config
from vistrain.optim import (
    LARS,
    build_lr_schedule,
    build_optimizer,
    build_schedules,
    clip_gradients,
    lr_scaling_note,
    param_group_key,
    set_lr,
)
from vistrain.optim import lars as lars_module
from vistrain.training.trainer import _build


def _opt_cfg(**overrides):
    cfg = get_defaults().OPTIMIZER
    for key, value in overrides.items():
        cfg[key] = value
    return cfg


class _Model(nn.Module):
    """trunk: conv(+bias) -> BN; head: linear -> BN1d -> linear (no bias)."""

    def __init__(self):
        super().__init__()
        self.trunk = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.AdaptiveAvgPool2d(1))
        self.head = nn.Sequential(
            nn.Flatten(), nn.Linear(4, 5), nn.BatchNorm1d(5), nn.Linear(5, 2, bias=False)
        )

    def forward(self, x):
        return self.head(self.trunk(x))


def _names_by_group(optimizer, model):
    names = {id(p): n for n, p in model.named_parameters()}
    return {g["name"]: sorted(names[id(p)] for p in g["params"]) for g in optimizer.param_groups}


# ------------------------------------------------------------------ parameter groups


def test_param_group_key_rules():
    cfg = _opt_cfg(regularize_bias=False, head_lr_multiplier=0.1)
    conv, bn, lin = nn.Conv2d(1, 1, 1), nn.BatchNorm2d(1), nn.Linear(1, 1)
    assert param_group_key("trunk.0.weight", conv, conv.weight, cfg) == "decay"
    assert param_group_key("trunk.0.bias", conv, conv.bias, cfg) == "no_decay"
    assert param_group_key("trunk.1.weight", bn, bn.weight, cfg) == "no_decay"
    assert param_group_key("head.1.weight", lin, None, cfg) == "head_decay"
    assert param_group_key("head.1.bias", lin, None, cfg) == "head_no_decay"
    assert param_group_key("header.weight", lin, None, cfg) == "decay"  # only "head." counts
    ln, gn = nn.LayerNorm(2), nn.GroupNorm(1, 2)
    assert (
        param_group_key("x.weight", ln, None, cfg) == param_group_key("y.bias", gn, None, cfg) == "no_decay"
    )
    lars = _opt_cfg(name="lars", regularize_bn=True)
    assert param_group_key("t.bias", conv, None, lars) == "decay_lars_exclude"
    assert param_group_key("t.weight", bn, None, lars) == "decay_lars_exclude"
    assert param_group_key("t.weight", conv, None, lars) == "decay"
    keep = _opt_cfg(name="lars", lars_exclude_bias_and_norm=False)
    assert param_group_key("t.weight", bn, None, keep) == "no_decay"


def test_groups_default_config_excludes_bn_from_decay():
    model = _Model()
    opt = build_optimizer(_opt_cfg(weight_decay=0.05), model)
    assert isinstance(opt, torch.optim.SGD)
    assert _names_by_group(opt, model) == {
        "decay": [
            "head.1.bias",
            "head.1.weight",
            "head.3.weight",
            "trunk.0.bias",
            "trunk.0.weight",
        ],
        "no_decay": ["head.2.bias", "head.2.weight", "trunk.1.bias", "trunk.1.weight"],
    }
    decay = {g["name"]: g["weight_decay"] for g in opt.param_groups}
    assert decay == {"decay": 0.05, "no_decay": 0.0}
    assert opt.defaults["momentum"] == 0.9 and all(g["lr"] == 0.1 for g in opt.param_groups)


def test_groups_head_multiplier_bias_and_frozen_params():
    model = _Model()
    model.trunk[0].weight.requires_grad_(False)
    cfg = _opt_cfg(regularize_bias=False, regularize_bn=True, head_lr_multiplier=0.5)
    opt = build_optimizer(cfg, model)
    assert _names_by_group(opt, model) == {
        "no_decay": ["trunk.0.bias"],
        "decay": ["trunk.1.bias", "trunk.1.weight"],
        "head_no_decay": ["head.1.bias"],
        "head_decay": ["head.1.weight", "head.2.bias", "head.2.weight", "head.3.weight"],
    }
    multipliers = {g["name"]: (g["lr_multiplier"], g["lr"]) for g in opt.param_groups}
    assert multipliers["head_decay"] == (0.5, 0.05) and multipliers["decay"] == (1.0, 0.1)
    set_lr(opt, 2.0)
    assert {g["name"]: g["lr"] for g in opt.param_groups} == {
        "no_decay": 2.0,
        "decay": 2.0,
        "head_no_decay": 1.0,
        "head_decay": 1.0,
    }


def test_adamw_and_lars_builders():
    model = _Model()
    adamw = build_optimizer(_opt_cfg(name="adamw", betas=[0.8, 0.95]), model)
    assert isinstance(adamw, torch.optim.AdamW) and adamw.defaults["betas"] == (0.8, 0.95)
    lars = build_optimizer(_opt_cfg(name="lars", lars_eta=0.02), model)
    assert isinstance(lars, LARS) and lars.defaults["eta"] == 0.02
    flags = {g["name"]: g["lars_exclude"] for g in lars.param_groups}
    assert flags == {"decay": False, "decay_lars_exclude": True, "no_decay_lars_exclude": True}
    assert _names_by_group(lars, model)["decay"] == [
        "head.1.weight",
        "head.3.weight",
        "trunk.0.weight",
    ]


def test_builder_errors():
    with pytest.raises(ValueError, match=r"unknown optimizer 'adam'; valid: \['adamw', 'lars', 'sgd'\]"):
        build_optimizer(_opt_cfg(name="adam"), _Model())
    frozen = nn.Linear(2, 2).requires_grad_(False)
    with pytest.raises(ValueError, match="no trainable parameters"):
        build_optimizer(_opt_cfg(), frozen)
    with pytest.raises(ValueError, match="betas"):
        build_optimizer(_opt_cfg(name="adamw", betas=[0.9]), _Model())


# ------------------------------------------------------------------ sharded parameters


def _sharded_groups_worker(rank, world, split_key):
    """Wrap _Model with the real engine (one unit); the optimizer's groups as (names, flags)."""
    from vistrain.fsdp import FullyShardedDataParallel, local_part

    cfg = _opt_cfg(name="lars", head_lr_multiplier=2.0)
    key_fn = functools.partial(param_group_key, opt_cfg=cfg) if split_key else None
    sharded = FullyShardedDataParallel(_Model(), param_group_fn=key_fn)
    opt = build_optimizer(cfg, sharded)
    groups = []
    for group in opt.param_groups:
        keys = {
            param_group_key(local_part(p).origin.fqn, local_part(p).origin.module, None, cfg)
            for p in group["params"]
        }
        groups.append((group["name"], sorted(keys), group["lars_exclude"], group["lr_multiplier"]))
    names = [name for name, _ in sharded.named_parameters()]
    return {
        "groups": groups,
        "names": names,
        "plain_names": [name for name, _ in _Model().named_parameters()],
    }


@pytest.mark.parametrize("split_key", [True, False])
def test_sharded_groups_hold_the_original_parameters_by_name(split_key):
    """Param groups (no decay on BN and biases, LARS exclusions, a head multiplier) classify the
    original parameters, by name, whether or not the engine flattens each group apart."""
    out = run_on_ranks(_sharded_groups_worker, 2, split_key)[0]
    assert out["names"] == out["plain_names"]
    for name, keys, _, _ in out["groups"]:
        assert keys == [name]
    flags = {name: (exclude, mult) for name, _, exclude, mult in out["groups"]}
    assert flags["head_decay"] == (False, 2.0) and flags["no_decay_lars_exclude"] == (True, 1.0)


# ------------------------------------------------------------------ LARS


def _plain_origin_sq_norms(params, tensors):
    """What origin_sq_sums returns for plain parameters: one squared norm per tensor."""
    return [SegmentValues.whole((t.float() * t.float()).sum(), t.numel()) for t in tensors]


def _reference_lars(ws, grads_per_step, lr, momentum, wd, eta, exclude, nesterov):
    """LARS written out per parameter in float64, one list entry per step."""
    ws = [w.double().clone() for w in ws]
    bufs = [None] * len(ws)
    for grads in grads_per_step:
        for i, (w, g) in enumerate(zip(ws, grads)):
            g = g.double()
            trust = 1.0
            if not exclude[i]:
                wn, gn = w.norm().item(), g.norm().item()
                trust = eta * wn / (gn + wd[i] * wn) if wn > 0 and gn > 0 else 1.0
            d = trust * (g + wd[i] * w)
            bufs[i] = d.clone() if bufs[i] is None else momentum * bufs[i] + d
            w -= lr * (d + momentum * bufs[i] if nesterov else bufs[i])
    return ws


@pytest.mark.parametrize("nesterov", [False, True])
def test_lars_matches_reference(nesterov):
    gen = torch.Generator().manual_seed(0)
    shapes = [(4, 3), (5,), (3,), (2, 2)]
    ws = [torch.randn(s, generator=gen) for s in shapes]
    ws[3].zero_()  # ||w|| = 0 -> trust ratio 1
    exclude = [False, False, True, False]
    wd = [1e-2, 1e-2, 0.0, 1e-2]
    steps = [[torch.randn(s, generator=gen) for s in shapes] for _ in range(3)]
    steps[0][1].zero_()  # ||g|| = 0 -> trust ratio 1 on the first step
    params = [nn.Parameter(w.clone()) for w in ws]
    groups = [
        {"params": [params[0], params[1], params[3]], "weight_decay": 1e-2, "lars_exclude": False},
        {"params": [params[2]], "weight_decay": 0.0, "lars_exclude": True},
    ]
    opt = LARS(groups, lr=0.5, momentum=0.9, eta=0.02, nesterov=nesterov)
    for grads in steps:
        for p, g in zip(params, grads):
            p.grad = g.clone()
        opt.step()
    ref = _reference_lars(ws, steps, 0.5, 0.9, wd, 0.02, exclude, nesterov)
    for p, r in zip(params, ref):
        torch.testing.assert_close(p.detach().double(), r, atol=1e-6, rtol=1e-6)
    assert set(opt.state[params[0]]) == {"momentum_buffer"}


def _segment_sq_norms(segments):
    """origin_sq_sums for flat params made of the given (start, end) segments (one 'rank')."""

    def norms(params, tensors):
        out = []
        for p, t in zip(params, tensors):
            if id(p) not in segments:
                out.append(SegmentValues.whole((t * t).sum(), t.numel()))
                continue
            values = torch.stack([(t[start:end] ** 2).sum() for start, end in segments[id(p)]])
            starts = [start for start, _ in segments[id(p)]]
            lengths = [end - start for start, end in segments[id(p)]]
            out.append(SegmentValues(values, starts, lengths, t.numel()))
        return out

    return norms


def test_lars_on_flat_shard_uses_per_original_norms(monkeypatch):
    """A flat param holding two originals (+ padding) steps exactly like the two separately."""
    gen = torch.Generator().manual_seed(1)
    a, b = torch.randn(6, generator=gen), torch.randn(4, generator=gen) * 10
    grads = [(torch.randn(6, generator=gen), torch.randn(4, generator=gen)) for _ in range(2)]
    flat = nn.Parameter(torch.cat([a, b, torch.zeros(2)]))
    separate = [nn.Parameter(a.clone()), nn.Parameter(b.clone())]
    monkeypatch.setattr(lars_module, "origin_sq_sums", _segment_sq_norms({id(flat): [(0, 6), (6, 10)]}))
    opt_flat = LARS([flat], lr=0.1, weight_decay=1e-3, eta=0.01)
    opt_sep = LARS(separate, lr=0.1, weight_decay=1e-3, eta=0.01)
    for ga, gb in grads:
        flat.grad = torch.cat([ga, gb, torch.zeros(2)])
        separate[0].grad, separate[1].grad = ga.clone(), gb.clone()
        opt_flat.step()
        opt_sep.step()
    torch.testing.assert_close(flat.detach()[:10], torch.cat([separate[0], separate[1]]).detach())
    assert torch.equal(flat.detach()[10:], torch.zeros(2))
    # The trust ratio differs per original: one norm over the whole flat would give another result.
    whole = nn.Parameter(torch.cat([a, b]))
    opt_whole = LARS([whole], lr=0.1, weight_decay=1e-3, eta=0.01)
    monkeypatch.setattr(lars_module, "origin_sq_sums", _plain_origin_sq_norms)
    for ga, gb in grads:
        whole.grad = torch.cat([ga, gb])
        opt_whole.step()
    assert not torch.allclose(whole.detach(), flat.detach()[:10])


_LARS_DDP_CFG = _opt_cfg(name="lars", lars_eta=0.05, head_lr_multiplier=3.0)


def _ddp_lars_worker(rank, world):
    torch.manual_seed(0)
    model = nn.parallel.DistributedDataParallel(_Model())
    opt = build_optimizer(_LARS_DDP_CFG, model)
    names = {g["name"]: g["lars_exclude"] for g in opt.param_groups}
    x = torch.randn(4, 3, 5, 5, generator=torch.Generator().manual_seed(rank))
    model(x).square().sum().backward()
    opt.step()
    return names, [p.detach() for p in model.module.parameters()]


def test_lars_under_ddp_matches_single_process():
    results = run_on_ranks(_ddp_lars_worker, 2)
    torch.manual_seed(0)
    model = _Model()
    opt = build_optimizer(_LARS_DDP_CFG, model)
    xs = [torch.randn(4, 3, 5, 5, generator=torch.Generator().manual_seed(r)) for r in range(2)]
    # DDP averages gradients; BN statistics stay per rank, so run the halves separately.
    for x in xs:
        (model(x).square().sum() / 2).backward()
    opt.step()
    for names, params in results:
        # "module." is stripped: head parameters are recognised behind DDP.
        assert names == {
            "decay": False,
            "decay_lars_exclude": True,
            "no_decay_lars_exclude": True,
            "head_decay": False,
            "head_decay_lars_exclude": True,
            "head_no_decay_lars_exclude": True,
        }
        for p, ref in zip(params, model.parameters()):
            torch.testing.assert_close(p, ref.detach(), atol=1e-6, rtol=1e-5)


def _train_two_steps(model, opt, rank, clip=None):
    for step in range(2):
        x = torch.randn(4, 3, 5, 5, generator=torch.Generator().manual_seed(10 * step + rank))
        model(x).square().sum().backward()
        if clip is not None:
            clip(model)
        opt.step()
        opt.zero_grad(set_to_none=True)


CLIP = 0.5  # clips some of _Model's parameters in these steps, not all


def _dino_clip_gradients(model):
    """DINO's utils.clip_gradients written out: each parameter's gradient norm clipped alone."""
    clipped = 0
    for p in model.parameters():
        if p.grad is not None:
            coef = CLIP / (p.grad.data.norm(2) + 1e-6)
            if coef < 1:
                p.grad.data.mul_(coef)
                clipped += 1
    return clipped


def _torch_sharded_model():
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from vistrain.fsdp import TorchShardedModel

    model, mesh = _Model(), init_device_mesh("cpu", (torch.distributed.get_world_size(),))
    fully_shard(model.head, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return TorchShardedModel(model)


def _sharded_lars_worker(rank, world):
    from vistrain.fsdp import FullyShardedDataParallel, auto_wrap, by_class

    torch.manual_seed(0)
    ddp = nn.parallel.DistributedDataParallel(_Model())
    _train_two_steps(ddp, build_optimizer(_LARS_DDP_CFG, ddp), rank)
    ref = {n: p.detach() for n, p in ddp.module.named_parameters()}
    group_fn = functools.partial(param_group_key, opt_cfg=_LARS_DDP_CFG)
    worst = {}
    for nested in (False, True):
        torch.manual_seed(0)
        model = _Model()
        if nested:  # each head Linear its own unit; the root keeps trunk + head BN
            model = auto_wrap(model, by_class([nn.Linear]), param_group_fn=group_fn)
        else:  # one unit: "decay" / "head_decay" flats hold several original parameters
            model = FullyShardedDataParallel(model, param_group_fn=group_fn)
        _train_two_steps(model, build_optimizer(_LARS_DDP_CFG, model), rank)
        state = model.state_dict()
        worst[nested] = max((state[n] - ref[n]).abs().max().item() for n in ref)
    # DINO's per-parameter clipping: the engine's (each original parameter's norm over the ranks'
    # parts) and torch's fully_shard against DDP with DINO's loop, plain SGD
    torch.manual_seed(0)
    ddp, clipped = nn.parallel.DistributedDataParallel(_Model()), []
    _train_two_steps(
        ddp, torch.optim.SGD(ddp.parameters(), 0.1), rank, lambda m: clipped.append(_dino_clip_gradients(m))
    )
    ref = {n: p.detach() for n, p in ddp.module.named_parameters()}
    for name, build in (
        ("engine", lambda: FullyShardedDataParallel(_Model())),
        ("torch", _torch_sharded_model),
    ):
        torch.manual_seed(0)
        model = build()
        clip = functools.partial(clip_gradients, max_norm=CLIP, per_parameter=True)
        _train_two_steps(model, torch.optim.SGD(model.parameters(), 0.1), rank, clip)
        state = model.state_dict()
        worst[f"clip {name}"] = max((state[n] - ref[n]).abs().max().item() for n in ref)
    return worst, clipped


@pytest.mark.parametrize("world", [2, 3])
def test_sharded_lars_and_per_parameter_clipping_equal_ddp(world):
    for worst, clipped in run_on_ranks(_sharded_lars_worker, world):
        assert max(worst.values()) < 1e-6, worst
        assert all(0 < n < len(list(_Model().parameters())) for n in clipped), clipped


def test_clipping_the_global_norm_or_each_parameters():
    torch.manual_seed(0)
    model, ref = _Model(), _Model()
    ref.load_state_dict(model.state_dict())
    x = torch.randn(4, 3, 5, 5)
    for m in (model, ref):
        m(x).square().sum().backward()
    clip_gradients(model, CLIP, per_parameter=True)
    _dino_clip_gradients(ref)
    for p, r in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, r.grad, rtol=1e-6, atol=0)
    grads = [p.grad.clone() for p in model.parameters()]
    clip_gradients(model, 0.1)  # torch's global norm
    total = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))
    for p, g in zip(model.parameters(), grads):
        torch.testing.assert_close(p.grad, g * 0.1 / (total + 1e-6))


def test_lars_rejects_bad_arguments():
    with pytest.raises(ValueError, match="eta > 0"):
        LARS([nn.Parameter(torch.ones(1))], lr=0.1, eta=0.0)
    with pytest.raises(ValueError, match="nesterov"):
        LARS([nn.Parameter(torch.ones(1))], lr=0.1, momentum=0.0, nesterov=True)


# ------------------------------------------------------------------ LR schedules


def _sched_cfg(**lr):
    cfg = _opt_cfg(num_epochs=10)
    for key, value in lr.items():
        cfg.param_schedulers.lr[key] = value
    return cfg


def test_cosine_with_fractional_warmup():
    cfg = _sched_cfg(
        name="cosine", base_value=0.1, end_value=0.001, warmup_epochs=1.5, start_warmup_value=0.01
    )
    lr = build_lr_schedule(cfg, iterations_per_epoch=10)  # 100 iterations, warmup 15
    # step t of the warm-up trains at the ramp's value where it ends: (t + 1) / 15 of the way
    assert lr(0) == pytest.approx(0.01 + 0.09 * 1 / 15)
    assert lr(5) == pytest.approx(0.01 + 0.09 * 6 / 15)
    assert lr(14) == pytest.approx(0.1) and lr(15) == pytest.approx(0.1)
    expected = 0.001 + 0.5 * 0.099 * (1 + math.cos(math.pi * (50 - 15) / 85))
    assert lr(50) == pytest.approx(expected)
    assert lr(99) == pytest.approx(0.001 + 0.5 * 0.099 * (1 + math.cos(math.pi * 84 / 85)))
    assert lr(100) == pytest.approx(0.001, abs=1e-12) and lr(1000) == pytest.approx(0.001, abs=1e-12)


def test_cosine_without_warmup():
    lr = build_lr_schedule(_sched_cfg(base_value=0.4, end_value=0.0), iterations_per_epoch=3)
    assert (
        lr(0) == pytest.approx(0.4)
        and lr(15) == pytest.approx(0.2)
        and lr(30) == pytest.approx(0.0, abs=1e-12)
    )


def test_multistep_boundaries_with_warmup():
    cfg = _sched_cfg(
        name="multistep",
        base_value=1.0,
        milestones=[3, 6.5],
        gamma=0.1,
        warmup_epochs=1,
        start_warmup_value=0.0,
    )
    lr = build_lr_schedule(cfg, iterations_per_epoch=10)
    assert lr(0) == pytest.approx(0.1) and lr(5) == pytest.approx(0.6) and lr(9) == pytest.approx(1.0)
    expected = {10: 1.0, 29: 1.0, 30: 0.1, 64: 0.1, 65: 0.01, 99: 0.01, 100: 0.01}
    assert {i: lr(i) for i in expected} == pytest.approx(expected)


def test_dinos_weight_decay_schedule_sets_the_decaying_groups():
    """DINO's utils.cosine_scheduler(0.04, 0.4, epochs, iterations), no warm-up, written out."""
    cfg = _opt_cfg(name="adamw", weight_decay=0.04, num_epochs=3)
    cfg.param_schedulers.weight_decay.name, cfg.param_schedulers.weight_decay.end_value = "cosine", 0.4
    steps = torch.arange(3 * 5, dtype=torch.float64)
    dino = 0.4 + 0.5 * (0.04 - 0.4) * (1 + torch.cos(math.pi * steps / len(steps)))
    optimizer, schedules = build_optimizer(cfg, _Model()), build_schedules(cfg, 5)
    del optimizer.param_groups[0]["weight_decay_multiplier"]  # a group saved before the key existed
    for i, want in enumerate(dino.tolist()):
        assert schedules.apply(optimizer, i) == schedules.lr(i)
        decays = {g["name"]: g["weight_decay"] for g in optimizer.param_groups}
        assert decays == pytest.approx({"decay": want, "no_decay": 0.0}, rel=1e-12)
    assert build_schedules(_opt_cfg(), 5).weight_decay is None  # constant: the groups' own


def test_constant_schedule():
    lr = build_lr_schedule(_sched_cfg(name="constant", base_value=0.3), iterations_per_epoch=4)
    assert [lr(i) for i in (0, 20, 39, 40, 100)] == [0.3] * 5


def test_schedule_errors():
    with pytest.raises(
        ValueError,
        match=r"unknown lr schedule 'linear'; valid: \['constant', 'cosine', 'multistep'\]",
    ):
        build_lr_schedule(_sched_cfg(name="linear"), 10)
    with pytest.raises(ValueError, match="warmup_epochs"):
        build_lr_schedule(_sched_cfg(warmup_epochs=10), 10)
    with pytest.raises(ValueError, match="below num_epochs"):
        build_lr_schedule(_sched_cfg(name="multistep", milestones=[3, 10]), 10)
    with pytest.raises(ValueError, match="increasing"):
        build_lr_schedule(_sched_cfg(name="multistep", milestones=[6, 3]), 10)
    with pytest.raises(ValueError, match="iterations_per_epoch"):
        build_lr_schedule(_sched_cfg(), 0)
    with pytest.raises(ValueError, match="iteration must be >= 0"):
        build_lr_schedule(_sched_cfg(), 5)(-1)


# ------------------------------------------------------------------ the linear scaling rule


def _scaled_cfg(**lr):
    cfg = _sched_cfg(**lr)
    cfg.param_schedulers.lr.auto_lr_scaling.auto_scale = True
    return cfg


def test_the_linear_scaling_rule_scales_every_value_of_the_schedule():
    """lr = value x global batch / base_lr_batch_size (256): the peak, the end and the warm-up."""
    cfg = _scaled_cfg(base_value=4e-3, end_value=1e-6, warmup_epochs=1, start_warmup_value=1e-4)
    plain = build_lr_schedule(_sched_cfg(base_value=4e-3, end_value=1e-6, warmup_epochs=1,
                                         start_warmup_value=1e-4), 10)  # fmt: skip
    half, double = build_lr_schedule(cfg, 10, global_batch=128), build_lr_schedule(cfg, 10, global_batch=512)
    for i in (0, 5, 9, 10, 50, 99, 100):
        assert half(i) == pytest.approx(plain(i) / 2) and double(i) == pytest.approx(plain(i) * 2)
    assert half(10) == pytest.approx(2e-3) and half(100) == pytest.approx(0.5e-6)
    assert lr_scaling_note(cfg.param_schedulers.lr, 128) == (
        "lr: base_value 0.004 x global batch 128 / 256 = 0.002 (OPTIMIZER.param_schedulers.lr."
        "auto_lr_scaling; end_value and warm-up scaled alike)"
    )
    assert lr_scaling_note(_sched_cfg().param_schedulers.lr, 128) is None
    assert build_lr_schedule(_sched_cfg(base_value=0.3), 10, global_batch=512)(0) == pytest.approx(0.3)
    with pytest.raises(ValueError, match="needs a global batch"):
        build_lr_schedule(cfg, 10)


def _scaled_lrs(rank, world, argv):
    """The first steps' lr of a run of ``argv`` built on this rank (data, model, optimizer)."""
    run = _build(load_config(argv), torch.device("cpu"))
    return [run.schedules.lr(i) for i in range(3)]


def test_twice_the_ranks_train_at_twice_the_lr(tmp_path):
    """The rule reads the job's global batch: ranks x per-rank batch x update_freq."""
    argv = [
        "config=test/simclr_tiny",
        "config.OPTIMIZER.param_schedulers.lr.auto_lr_scaling.auto_scale=True",
        "config.OPTIMIZER.param_schedulers.lr.auto_lr_scaling.base_lr_batch_size=8",
        "config.OPTIMIZER.param_schedulers.lr.name=constant",  # the same lr per step on 2 and 4 ranks
        "config.OPTIMIZER.param_schedulers.lr.warmup_epochs=0",
        f"config.CHECKPOINT.DIR={tmp_path}",
    ]
    cfg = load_config(argv)
    batch, lr = cfg.DATA.TRAIN.BATCHSIZE_PER_REPLICA, cfg.OPTIMIZER.param_schedulers.lr
    two, four = run_on_ranks(_scaled_lrs, 2, argv)[0], run_on_ranks(_scaled_lrs, 4, argv)[0]
    accumulated = run_on_ranks(_scaled_lrs, 2, [*argv, "config.OPTIMIZER.update_freq=2"])[0]
    assert two == pytest.approx([lr.base_value * 2 * batch / 8] * 3)
    assert four == pytest.approx([2 * x for x in two]) and accumulated == pytest.approx(four)


@pytest.mark.parametrize(
    "recipe, override, line",
    [
        ("test/simclr_tiny", "config.OPTIMIZER.param_schedulers.lr.auto_lr_scaling.base_lr_batch_size=0",
         "OPTIMIZER.param_schedulers.lr.auto_lr_scaling.base_lr_batch_size must be >= 1"),
        ("test/finetune_tiny", "config.LOG_FREQUENCY=1",
         "OPTIMIZER.param_schedulers.lr.auto_lr_scaling scales pretraining's lr; JOB finetune"),
    ],
)  # fmt: skip
def test_a_bad_scaling_value_is_one_line_exit_2(recipe, override, line, tmp_path, capsys):
    argv = [
        f"config={recipe}",
        "config.OPTIMIZER.param_schedulers.lr.auto_lr_scaling.auto_scale=True",
        f"config.CHECKPOINT.DIR={tmp_path}",
        override,
    ]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and line in err, err
