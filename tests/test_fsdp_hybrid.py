"""Hybrid sharding (shard within a group, replicate across groups) equals DDP over the world.

Real gloo ranks: 4 ranks as 2 groups of 2 and 6 ranks as 2 groups of 3, SGD and LARS, clipping,
ZeRO-2, gradient accumulation, BatchNorm buffers; the rank arithmetic over many world sizes.
"""

import pytest
import torch
import torch.distributed as dist
from fsdp_models import Block, local_batch, make_net, make_optimizer, max_rel_diff, train, wrap
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from vistrain.distributed.testing import run_on_ranks
from vistrain.fsdp import auto_wrap, by_class, hybrid_groups, replica_group_ranks, shard_group_ranks
from vistrain.fsdp.collectives import shard_group_size_problem
from vistrain.optim.lars import LARS

TOL = 1e-5
STEPS = 6


# -- rank arithmetic (pure) -------------------------------------------------------------------------
@pytest.mark.parametrize("world", range(1, 17))
def test_shard_and_replica_groups_tile_the_world(world):
    for k in [0] + [d for d in range(1, world + 1) if world % d == 0]:
        shards, replicas = shard_group_ranks(world, k), replica_group_ranks(world, k)
        size = k or world
        assert sorted(r for g in shards for r in g) == list(range(world))
        assert sorted(r for g in replicas for r in g) == list(range(world))
        assert all(len(g) == size for g in shards) and len(replicas) == size
        assert all(g == tuple(range(g[0], g[0] + size)) for g in shards)  # consecutive: a node
        for position, group in enumerate(replicas):  # the same shard position in every group
            assert [shards[r // size].index(r) for r in group] == [position] * len(group)
            assert [r // size for r in group] == list(range(world // size))
        assert shard_group_size_problem(world, k) is None


def test_bad_shard_group_sizes_say_why():
    assert "must divide the world size (6)" in shard_group_size_problem(6, 4)
    assert "got -1" in shard_group_size_problem(4, -1)
    with pytest.raises(ValueError, match="shard_group_size"):
        shard_group_ranks(6, 4)
    assert shard_group_ranks(6, 3) == [(0, 1, 2), (3, 4, 5)]
    assert replica_group_ranks(6, 3) == [(0, 3), (1, 4), (2, 5)]
    assert replica_group_ranks(4, 0) == [(0,), (1,), (2,), (3,)]


# -- parity with DDP over the world -----------------------------------------------------------------
class BNNet(nn.Module):
    """BatchNorm without SyncBN: running statistics follow the first rank's (broadcast_buffers)."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Conv2d(3, 5, 3, padding=1)
        self.bn = nn.BatchNorm2d(5)
        self.blocks = nn.Sequential(Block(5))
        self.head = nn.Linear(5, 7)

    def forward(self, x):
        return self.head(self.blocks(torch.relu(self.bn(self.stem(x)))).mean((2, 3)))


def _optimizer(name, params):
    if name == "lars":
        return LARS(params, lr=0.1, momentum=0.9, weight_decay=1e-4)
    return make_optimizer(name, params)


def _accumulating(model, optimizer, rank, world, steps=3):
    """Two micro-batches per step, the first under no_sync (update_freq=2)."""
    for step in range(steps):
        for micro in range(2):
            x, y = local_batch(2 * step + micro, rank, world)
            context = model.no_sync() if micro == 0 else torch.enable_grad()
            with context:
                nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)


def _hybrid_worker(rank, world, k):
    groups = hybrid_groups(k)
    out = {}
    cases = {
        "sgd": ("sgd", {}, None),
        "lars": ("lars", {}, None),
        "sgd_clip_zero2": ("sgd", {"reshard_after_forward": False}, 0.05),
    }
    for name, (optim, kwargs, clip) in cases.items():
        ref = DDP(make_net())
        ref_losses = train(ref, _optimizer(optim, ref.parameters()), rank, world, STEPS, clip)
        model = wrap(make_net(), True, groups=groups, **kwargs)
        losses = train(model, _optimizer(optim, model.parameters()), rank, world, STEPS, clip)
        out[name] = (
            max_rel_diff(losses, ref_losses),
            max_rel_diff(model.state_dict(), ref.module.state_dict()),
        )
    ref, model = DDP(make_net()), wrap(make_net(), True, groups=groups)
    for m in (ref, model):
        _accumulating(m, make_optimizer("sgd", m.parameters()), rank, world)
    out["no_sync"] = (0.0, max_rel_diff(model.state_dict(), ref.module.state_dict()))
    torch.manual_seed(0)
    ref = DDP(BNNet())  # broadcast_buffers: the world's rank 0's statistics
    torch.manual_seed(0)
    model = auto_wrap(BNNet(), by_class([Block]), groups=groups)
    for m in (ref, model):
        train(m, make_optimizer("sgd", m.parameters()), rank, world, 3)
        m(local_batch(9, rank, world)[0])  # the first rank's statistics, then this rank's batch
    state = model.state_dict()
    out["batchnorm"] = (0.0, max_rel_diff(state, ref.module.state_dict()))
    # every replica holds the same shards
    shards = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    gathered = [torch.empty_like(shards) for _ in range(groups.replicas)]
    dist.all_gather(gathered, shards, group=groups.replica)
    out["replicas_identical"] = all(torch.equal(g, shards) for g in gathered)
    return out


@pytest.mark.parametrize(
    "world,k", [(4, 2), (6, 3), (4, 1)], ids=["4_ranks_2x2", "6_ranks_2x3", "4_ranks_replicated"]
)
def test_hybrid_sharding_equals_ddp_over_the_world(world, k):
    for result in run_on_ranks(_hybrid_worker, world, k):
        assert result.pop("replicas_identical")
        for name, (loss_diff, state_diff) in result.items():
            assert loss_diff < TOL and state_diff < TOL, (name, loss_diff, state_diff)


def _final_grad_worker(rank, world):
    """The one hook point: ``on_shard_grad_ready`` sees each shard gradient already averaged over
    the world (after the cross-replica all-reduce), and the reductions' groups overlap."""
    model = wrap(make_net(), True, groups=hybrid_groups(2))
    x, y = local_batch(0, rank, world)
    nn.functional.cross_entropy(model(x), y).backward()  # builds the model state
    model.zero_grad(set_to_none=True)
    seen = {}
    queue = model.model_state.reductions

    def note(handle):
        for p in handle.local_params:
            seen.setdefault(id(p), p.grad.clone())

    queue.on_shard_grad_ready = note
    nn.functional.cross_entropy(model(x), y).backward()
    ready = all(torch.equal(seen[id(p)], p.grad) for p in model.parameters())
    return ready and len(seen) == len(list(model.parameters())), sorted(queue.reduction_groups)


def test_shard_gradients_are_final_when_announced():
    for rank, (ready, groups) in enumerate(run_on_ranks(_final_grad_worker, 4)):
        assert ready
        assert groups == sorted([(rank // 2 * 2, rank // 2 * 2 + 1), (rank % 2, rank % 2 + 2)])


def _gather_groups_worker(rank, world):
    """Per shard group size: (gathers on a group of their own over the shard group's ranks,
    a world all-reduce issued while a prefetched gather is in flight returns, the loss)."""
    out = []
    for k in (0, 2, 1):
        model = wrap(make_net(), True, groups=hybrid_groups(k))
        x, y = local_batch(0, rank, world)
        nn.functional.cross_entropy(model(x), y).backward()  # builds the model state
        handles = model.model_state.handles()
        own = all(
            dist.get_process_group_ranks(h.gather_group) == dist.get_process_group_ranks(h.groups.shard)
            and (h.gather_group is not h.groups.shard or dist.get_world_size(h.groups.shard) == 1)
            for h in handles
        )
        handles[-1].start_unshard()  # a prefetch in flight, as in forward
        flag = torch.ones(1)
        dist.all_reduce(flag)  # the user's collective on the world (sync BN, a loss)
        handles[-1].reshard()  # waits for the prefetch, frees it
        out.append((own, flag.item(), nn.functional.cross_entropy(model(x), y).item()))
    return out


def test_gathers_run_on_groups_of_their_own():
    """So that what the user runs on the shard group (sync BatchNorm's all-reduces, a loss's
    all-gather) never waits behind a prefetched unit's bytes on the same connections."""
    for result in run_on_ranks(_gather_groups_worker, 4):
        assert [own for own, _, _ in result] == [True] * 3
        assert [flag for _, flag, _ in result] == [4.0] * 3
        losses = [loss for _, _, loss in result]
        assert losses[0] == pytest.approx(losses[1]) == pytest.approx(losses[2])


# -- AUTO_SETUP_FSDP with shard_group_size: the recipes' options ------------------------------------
# bf16 gathers and compute (fp32 reductions) under AMP, against DDP under AMP (as test_auto_setup)
AMP = [
    "config.MODEL.AMP_PARAMS.USE_AMP=True",
    "config.MODEL.FSDP_CONFIG.mixed_precision=True",
    "config.MODEL.FSDP_CONFIG.compute_dtype=bfloat16",
]


def _recipe_worker(rank, world, method, cases):
    import test_auto_setup as auto

    # At 4 ranks the SimCLR recipe flips discretely after step 8: DDP itself with its initial
    # weights scaled by (1 + 1e-6) ends 1.1e-3 (relative) away in one BatchNorm bias, while
    # (1 +- 1e-7, 3e-7) stay below 5e-6. On an AMD EPYC machine LARS with parameter groups jumps
    # from 1.9e-6 after step 2 to 2.4e-4 after step 3 in two BatchNorm biases (deterministic;
    # LARS alone and the groups alone stay below 1e-6): two steps (this process only).
    auto.STEPS = 2
    out = {}
    for name in cases:
        overrides = AMP if name == "amp" else auto.CASES[name]
        cfg = auto.recipe(
            method,
            "config.MODEL.SYNC_BN_CONFIG.CONVERT_BN_TO_SYNC_BN=True",
            auto.PARITY_LR,
            "config.MODEL.FSDP_CONFIG.shard_group_size=2",
            *overrides,
        )
        ref_losses, ref_state, _ = auto.run(cfg, False, rank, world)
        losses, state, model = auto.run(cfg, True, rank, world)
        hybrid = all(
            h.groups.replicas == world // 2 and h.world_size == 2
            for u in model.units()
            for h in u.unit_state.handles
        )
        out[name] = (max_rel_diff(losses, ref_losses), max_rel_diff(state, ref_state), hybrid)
    return out


@pytest.mark.parametrize(
    "method,cases",
    [
        ("simclr", ["sgd", "lars_param_groups", "amp"]),
        ("swav", ["checkpointing_no_reshard", "stage_checkpointing_unflattened"]),
    ],
)
def test_auto_setup_with_shard_groups_equals_ddp(method, cases):
    for name, (loss_diff, state_diff, hybrid) in run_on_ranks(_recipe_worker, 4, method, cases)[0].items():
        assert hybrid, name
        if name == "amp":  # bf16 rounding: DDP's AMP differs from ours in what runs in bf16
            assert loss_diff < 1e-2, (name, loss_diff)
        else:
            assert loss_diff < TOL and state_diff < TOL, (name, loss_diff, state_diff)


# -- BACKEND=torch: FSDP2 on a 2-D (replicate, shard) mesh -----------------------------------------
def _torch_mesh_worker(rank, world, run_dir):
    import test_auto_setup as auto

    from vistrain.checkpoint import save_sharded_checkpoint

    auto.STEPS = 6  # see _recipe_worker
    ref_losses, ref_state, _ = auto.run(auto.recipe("simclr"), False, rank, world)
    cfg = auto.recipe(
        "simclr", "config.MODEL.FSDP_CONFIG.BACKEND=torch", "config.MODEL.FSDP_CONFIG.shard_group_size=2"
    )
    losses, state, model = auto.run(cfg, True, rank, world)
    save_sharded_checkpoint(run_dir, 6, model, None, {}, {}, keep_last=0)
    param = next(model.parameters())
    mesh = (
        tuple(param.device_mesh.shape),
        param.device_mesh.mesh_dim_names,
        [str(p) for p in param.placements],
    )
    return max_rel_diff(losses, ref_losses), max_rel_diff(state, ref_state), mesh, state


def test_torch_backend_takes_the_same_key_as_a_2d_mesh(tmp_path):
    from vistrain.checkpoint import consolidated_state_dict, find_latest_checkpoint

    loss_diff, state_diff, mesh, state = run_on_ranks(_torch_mesh_worker, 4, str(tmp_path))[0]
    assert mesh == ((2, 2), ("replicate", "shard"), ["R", "S(0)"])
    assert loss_diff < TOL and state_diff < TOL, (loss_diff, state_diff)
    saved = consolidated_state_dict(find_latest_checkpoint(str(tmp_path)))
    assert saved.keys() == state.keys() and all(torch.equal(saved[k], state[k]) for k in state)


# -- the optimizer step inside backward (issue 21) on hybrid shards ---------------------------------
def _in_backward_worker(rank, world, opt_names):
    import functools

    import test_optim_in_backward as iib

    from vistrain.fsdp import apply_optimizer_in_backward
    from vistrain.optim import build_optimizer, param_group_key

    groups = hybrid_groups(2)
    out = {}
    for opt_name in opt_names:
        cfg = iib._opt_cfg(opt_name)
        runs = []
        for in_backward in (False, True):
            torch.manual_seed(0)
            group_fn = functools.partial(param_group_key, opt_cfg=cfg)
            model = auto_wrap(
                iib.Model(),
                by_class([nn.Linear, nn.Conv2d]),
                param_group_fn=group_fn,
                groups=groups,
            )
            optimizer = build_optimizer(cfg, model)
            if in_backward:  # steps each shard once its gradient is averaged over the world
                apply_optimizer_in_backward(model, optimizer)
            iib._train(model, optimizer, cfg, rank, in_backward, 2, True)  # update_freq 2
            runs.append((model.state_dict(), [optimizer.state[p] for p in model.parameters()]))
        (ref, ref_states), (weights, states) = runs
        out[opt_name] = max(
            max((weights[k] - ref[k]).abs().max().item() for k in ref),
            max(
                (a[key].float() - b[key].float()).abs().max().item() if b[key].numel() else 0.0
                for a, b in zip(states, ref_states)
                for key in b
            ),
        )
    return out


def test_step_in_backward_on_hybrid_shards_equals_the_ordinary_step():
    for result in run_on_ranks(_in_backward_worker, 4, ["sgd", "lars", "adamw"]):
        assert all(diff < 1e-6 for diff in result.values()), result


def _trainer_worker(rank, world, run_dir, overrides):
    from vistrain.methods import load_config
    from vistrain.training.trainer import train

    argv = [
        "config=test/swav_tiny",
        f"config.CHECKPOINT.DIR={run_dir}",
        "config.LOG_FREQUENCY=1",
        "config.OPTIMIZER.num_epochs=1",
        "config.OPTIMIZER.name=lars",
        "config.MODEL.FSDP_CONFIG.AUTO_SETUP_FSDP=True",
        "config.MODEL.FSDP_CONFIG.shard_group_size=2",
        f"config.DISTRIBUTED.NUM_PROC_PER_NODE={world}",
        *overrides,
    ]
    train(load_config(argv))


def test_trainer_with_shard_groups_and_the_step_in_backward(tmp_path):
    import json

    losses = {}
    for name, overrides in {"step": [], "in_backward": ["config.OPTIMIZER.step_in_backward=True"]}.items():
        run_on_ranks(_trainer_worker, 4, str(tmp_path / name), overrides)
        lines = (tmp_path / name / "metrics.jsonl").read_text().splitlines()
        losses[name] = torch.tensor([json.loads(line)["loss"] for line in lines], dtype=torch.float64)
    assert len(losses["step"]) > 1
    torch.testing.assert_close(losses["in_backward"], losses["step"], rtol=1e-5, atol=0)


def _different_seeds_worker(rank, world):
    """sync_module_states: ranks built from different seeds start from the world's first rank's
    weights and buffers (shard group broadcast, then replica group)."""
    groups = hybrid_groups(2)
    torch.manual_seed(rank)
    model = auto_wrap(BNNet(), by_class([Block]), groups=groups)
    torch.manual_seed(0)
    return max_rel_diff(model.state_dict(), BNNet().state_dict())


def test_replicas_start_from_the_first_ranks_weights():
    assert run_on_ranks(_different_seeds_worker, 4) == [0.0] * 4
