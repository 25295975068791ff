"""Per-unit initialisation: a model built on the meta device and created unit by unit by the
sharded engine starts from exactly the weights of a plain build with the same seed."""

import functools

import pytest
import torch
from torch import nn

from vistrain.checkpoint.pretrained import load_pretrained
from vistrain.distributed.testing import run_on_ranks
from vistrain.fsdp.deferred_init import build_on_meta, materialize
from vistrain.fsdp.memory import storage_bytes
from vistrain.methods import build_model, load_config
from vistrain.optim import param_group_key
from vistrain.runtime.sharding import build_for_run, shard_model


def recipe(method, *overrides):
    return load_config([f"config=test/{method}_tiny", *overrides])


def plain_build(cfg, seed):
    torch.manual_seed(seed)
    model = build_model(cfg.MODEL)
    return model, torch.random.get_rng_state()


@pytest.mark.parametrize("method", ["simclr", "swav"])
def test_meta_build_replays_every_tensor_bit_for_bit(method):
    cfg = recipe(method)
    plain, rng_after_plain = plain_build(cfg, 7)
    torch.manual_seed(7)
    meta = build_on_meta(build_model, cfg.MODEL)
    # The generator advanced exactly as in the plain build: what runs next sees the same state.
    assert torch.equal(torch.random.get_rng_state(), rng_after_plain)
    tensors = list(meta.named_parameters()) + list(meta.named_buffers())
    assert storage_bytes(t for _, t in tensors) == 0  # nothing allocated
    assert not any(vars(t) for _, t in tensors)  # the records live in the registry, not on the tensors
    reference = plain.state_dict()
    assert sorted(name for name, _ in tensors) == sorted(reference)
    for name, t in tensors:
        value = materialize(t)
        assert value.dtype == reference[name].dtype and torch.equal(value, reference[name]), name
    assert torch.equal(torch.random.get_rng_state(), rng_after_plain)  # replay leaves it alone


class _ScaledOutOfPlace(nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(3) * 2)


class _WrittenThroughView(nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(4))
        with torch.no_grad():
            self.weight[:2].fill_(1.0)


class _OwnGenerator(nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(4))
        nn.init.normal_(self.weight, generator=torch.Generator().manual_seed(0))


class _TorchTruncNormal(nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(4))
        nn.init.trunc_normal_(self.weight, std=0.02)


def test_a_value_computed_out_of_place_is_replayed():
    """timm's layer scale: ``nn.Parameter(init * torch.ones(d))``, then changed in place."""
    torch.testing.assert_close(materialize(build_on_meta(_ScaledOutOfPlace).weight), torch.full((3,), 2.0))


def test_unreplayable_initialisations_fail_loudly_at_build_time():
    with pytest.raises(ValueError, match="torch.nn.init.trunc_normal_ leaves meta tensors untouched"):
        build_on_meta(_TorchTruncNormal)
    with pytest.raises(ValueError, match="cannot initialise weight unit by unit: .*through a view"):
        build_on_meta(_WrittenThroughView)
    with pytest.raises(ValueError, match="explicit generator"):
        build_on_meta(_OwnGenerator)
    with pytest.raises(ValueError, match="no recorded initialisation"):
        materialize(torch.empty(2, device="meta"))


def _sharded_init_worker(rank, world, method, weights_file):
    cfg = recipe(
        method,
        "config.MODEL.FSDP_CONFIG.AUTO_SETUP_FSDP=True",
        f"config.MODEL.WEIGHTS_INIT.PARAMS_FILE={weights_file}",
    )
    torch.manual_seed(cfg.SEED_VALUE)
    model = build_for_run(build_model, cfg.MODEL)
    assert all(p.is_meta for p in model.parameters())
    if weights_file:
        load_pretrained(model, cfg.MODEL.WEIGHTS_INIT)
    sharded = shard_model(model, cfg.MODEL, functools.partial(param_group_key, opt_cfg=cfg.OPTIMIZER))
    held = sum(p.numel() for p in sharded.parameters())
    return sharded.state_dict(), held, torch.random.get_rng_state()


@pytest.mark.parametrize("world", [2, 3])
def test_per_unit_init_equals_plain_init_on_any_world_size(world, tmp_path):
    cfg = recipe("swav")
    plain, rng_after_plain = plain_build(cfg, cfg.SEED_VALUE)
    reference = plain.state_dict()
    total = sum(p.numel() for p in plain.parameters())
    for state, held, rng in run_on_ranks(_sharded_init_worker, world, "swav", ""):
        assert sorted(state) == sorted(reference)
        for name, value in state.items():
            assert torch.equal(value, reference[name]), name
        assert held < total / world + 64 * world  # only this rank's shards (plus padding)
        assert torch.equal(rng, rng_after_plain)
    # WEIGHTS_INIT on a meta model: the values come from the file, read unit by unit.
    other, _ = plain_build(cfg, 123)
    torch.save(other.state_dict(), tmp_path / "weights.torch")
    for state, _, _ in run_on_ranks(_sharded_init_worker, world, "swav", str(tmp_path / "weights.torch")):
        for name, value in other.state_dict().items():
            assert torch.equal(state[name], value), name
