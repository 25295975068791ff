"""Checkpoints of hybrid-sharded models: one copy of each shard on disk, resumed on any world size
and group size either way round, bit-identical state; conversion of a hybrid recipe's checkpoint.

Same harness as ``test_checkpoint.py`` (each rank's own pieces, assembled with the engine's rank
arithmetic, are the reference for "identical state").
"""

import os

import pytest
import test_checkpoint as base
import torch
from fsdp_models import Block, make_net, make_optimizer
from torch import nn

from vistrain.checkpoint import (
    consolidated_state_dict,
    find_latest_checkpoint,
    load_sharded_checkpoint,
    read_metadata,
    save_sharded_checkpoint,
    to_torchvision,
)
from vistrain.distributed.testing import run_on_ranks
from vistrain.fsdp import auto_wrap, by_class, hybrid_groups
from vistrain.methods import load_config
from vistrain.training.trainer import train


def _build(shard_group_size, seed):
    net = make_net(seed)
    net.stem.bias.requires_grad_(False)  # a frozen parameter: no optimizer state
    return auto_wrap(net, by_class([Block, nn.Linear]), groups=hybrid_groups(shard_group_size))


def _save_worker(rank, world, k, run_dir):
    model = _build(k, seed=0)
    optimizer = make_optimizer("sgd", [p for p in model.parameters() if p.requires_grad])
    for step in range(base.SAVED_AT):
        base._step(model, optimizer, step, rank, world)
    save_sharded_checkpoint(run_dir, base.SAVED_AT, model, optimizer, {"rank": rank}, {}, keep_last=0)
    saved = base._owned_state(model, optimizer)
    steps = range(base.SAVED_AT, base.SAVED_AT + base.MORE)
    return saved, [base._step(model, optimizer, step, rank, world) for step in steps]


def _resume_worker(rank, world, k, run_dir):
    model = _build(k, seed=1)  # other initial weights: everything must come from the file
    optimizer = make_optimizer("sgd", [p for p in model.parameters() if p.requires_grad])
    load_sharded_checkpoint(find_latest_checkpoint(run_dir), model, optimizer)
    state = base._owned_state(model, optimizer)
    steps = range(base.SAVED_AT, base.SAVED_AT + base.MORE)
    return state, [base._step(model, optimizer, step, rank, world) for step in steps]


def _check_resumes(run_dir, saved, layouts):
    reference = base._assemble([s for s, _ in saved])
    for world, k in layouts:
        results = run_on_ranks(_resume_worker, world, k, run_dir)
        state = base._assemble([r[0] for r in results])
        assert state.keys() == reference.keys()
        for fqn in reference:
            assert state[fqn].keys() == reference[fqn].keys(), (world, k, fqn)
            for key in reference[fqn]:
                assert torch.equal(state[fqn][key], reference[fqn][key]), (world, k, fqn, key)
        # the same layout sums in the same order: the continuation is bit-identical
        atol = 0 if (world, k) == layouts[0] else 1e-6
        torch.testing.assert_close(results[0][1], saved[0][1], rtol=0, atol=atol)


def test_hybrid_checkpoint_holds_one_copy_and_resumes_on_any_layout(tmp_path):
    """4 ranks as 2 groups of 2 -> 2x2 again, full sharding on 2 and 3 ranks, 6 ranks as 2x3."""
    run_dir = str(tmp_path)
    saved = run_on_ranks(_save_worker, 4, 2, run_dir)
    folder = tmp_path / "checkpoint_3"
    meta = read_metadata(str(folder))
    writers = {rank for info in meta["params"].values() for rank, _, _ in info["slices"]}
    assert writers == {0, 1}  # the first replica's ranks: each shard once
    assert set(os.listdir(folder)) == {"metadata.json"} | {f"rank{r}.pt" for r in range(4)}
    saved_elements = sum(n for info in meta["params"].values() for _, _, n in info["slices"])
    assert saved_elements == sum(p.numel() for p in make_net().parameters())
    _check_resumes(run_dir, saved, [(4, 2), (2, 0), (3, 0), (6, 3)])


def test_full_shard_checkpoint_resumes_as_hybrid(tmp_path):
    run_dir = str(tmp_path)
    saved = run_on_ranks(_save_worker, 2, 0, run_dir)
    _check_resumes(run_dir, saved, [(2, 0), (4, 2), (4, 1)])


def _hybrid_recipe_worker(rank, world, run_dir):
    argv = base._tiny(
        run_dir,
        "config.OPTIMIZER.num_epochs=1",
        "config.MODEL.FSDP_CONFIG.AUTO_SETUP_FSDP=true",
        "config.MODEL.FSDP_CONFIG.shard_group_size=2",
        "config.DISTRIBUTED.NUM_PROC_PER_NODE=4",
    )
    train(load_config(argv))


@pytest.mark.parametrize("ranks", [4])
def test_hybrid_recipe_checkpoint_converts_to_consolidated_and_torchvision(tmp_path, ranks):
    import torchvision

    from vistrain.methods import build_model
    from vistrain.models.trunks.regnet import block_params_from_config

    run_on_ranks(_hybrid_recipe_worker, ranks, str(tmp_path))
    ckpt = find_latest_checkpoint(str(tmp_path))
    cfg = load_config(base._tiny(tmp_path))
    consolidated = consolidated_state_dict(ckpt)
    ours = build_model(cfg.MODEL).eval()
    assert consolidated.keys() == ours.state_dict().keys()
    ours.load_state_dict(consolidated)
    to_torchvision(ckpt, str(tmp_path / "tv.pt"))
    tv = torchvision.models.regnet.RegNet(block_params_from_config(cfg.MODEL.TRUNK.REGNET), stem_width=8)
    tv.fc = nn.Identity()
    tv.load_state_dict(torch.load(tmp_path / "tv.pt", weights_only=True), strict=True)
    x = torch.randn(3, 3, 16, 16)
    with torch.no_grad():
        torch.testing.assert_close(tv.eval()(x), ours.trunk(x)["avgpool"], rtol=1e-5, atol=1e-6)
