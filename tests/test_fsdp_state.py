"""Who owns the engine's state: units and models keep their own, process groups are created by
every rank together, phase changes are checked, nothing is pinned on the user's objects."""

import ast
import datetime
import pathlib

import pytest
import torch
import torch.distributed as dist
from fsdp_models import Block, gathered_bytes, local_batch, make_net, make_optimizer, max_rel_diff, wrap
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import vistrain.fsdp
from vistrain.distributed.testing import run_on_ranks
from vistrain.fsdp import FullyShardedDataParallel as FSDP
from vistrain.fsdp import ShardGroups, auto_wrap, by_class
from vistrain.fsdp.collectives import CollectiveError, CollectiveTimeout, wait_within
from vistrain.fsdp.unit import MODEL_TRANSITIONS, UNIT_TRANSITIONS, Phase, checked_transition

TOL = 1e-5


def _step(model, optimizer, x, y):
    loss = nn.functional.cross_entropy(model(x), y)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss.item()


# -- subgroups: ranks that shard over different groups ---------------------------------------------
def _subgroup_worker(rank, world, partition):
    """Each rank shards over its part of ``partition``; each part equals DDP run inside it."""
    groups = [dist.new_group(part) for part in partition]  # every rank creates every group
    members = next(part for part in partition if rank in part)
    group = groups[partition.index(members)]
    group_rank, group_world = members.index(rank), len(members)
    created, new_group = [], dist.new_group

    def recording_new_group(ranks=None, *args, **kwargs):
        created.append(list(ranks) if ranks is not None else None)
        return new_group(ranks, *args, **kwargs)

    dist.new_group = recording_new_group  # the engine's calls from here on
    out = {}
    for name, make in {
        "linear": lambda: nn.Linear(10, 7),
        "nested": lambda: make_net(),
    }.items():
        torch.manual_seed(0)
        ref = DDP(make(), process_group=group)
        torch.manual_seed(0)
        plain = make()
        model = (
            FSDP(plain, ShardGroups(group))
            if name == "linear"
            else wrap(plain, True, groups=ShardGroups(group))
        )
        ref_opt, opt = make_optimizer("sgd", ref.parameters()), make_optimizer("sgd", model.parameters())
        losses, ref_losses = [], []
        for step in range(3):
            x, y = local_batch(step, group_rank, group_world)
            x = x.mean((1, 2, 3)).unsqueeze(1).repeat(1, 10) if name == "linear" else x
            losses.append(_step(model, opt, x, y))
            ref_losses.append(_step(ref, ref_opt, x, y))
        out[name] = (
            max_rel_diff(losses, ref_losses),
            max_rel_diff(model.state_dict(), ref.module.state_dict()),
        )
    dist.new_group = new_group
    everyone = [None] * world
    dist.all_gather_object(everyone, created)  # new_group's contract: the same calls on every rank
    return out, all(calls == created for calls in everyone)


@pytest.mark.parametrize("partition", [[[0, 1], [2]], [[0, 1], [2, 3]]], ids=["0-1_2", "0-1_2-3"])
def test_ranks_sharding_over_different_groups_train_and_equal_ddp_in_each_group(partition):
    """The first: the reported hang; the second: hybrid sharding's pattern (a group per node)."""
    world = sum(len(part) for part in partition)
    for per_model, same_group_calls in run_on_ranks(_subgroup_worker, world, partition):
        assert same_group_calls, "ranks created different process groups (new_group must match)"
        for name, (loss_diff, state_diff) in per_model.items():
            assert loss_diff < TOL and state_diff < TOL, (name, loss_diff, state_diff)


# -- two wrapped models in one process ------------------------------------------------------------
def _two_models_worker(rank, world):
    other = dist.new_group(list(range(world)))  # the same ranks, another group
    a, b = wrap(make_net(0), True), wrap(make_net(1), True, groups=ShardGroups(other))
    ref_a, ref_b = DDP(make_net(0)), DDP(make_net(1), process_group=other)
    engines = [(m, make_optimizer("sgd", m.parameters())) for m in (a, b, ref_a, ref_b)]
    losses = [[] for _ in engines]
    for step in range(3):  # side by side: steps interleaved
        x, y = local_batch(step, rank, world)
        for out, (model, optimizer) in zip(losses, engines):
            out.append(_step(model, optimizer, x, y))
    x, y = local_batch(3, rank, world)
    pending_b = b(x)  # b's root stays gathered until its backward; a holds nothing
    only_b_gathered = gathered_bytes(b) > 0 and gathered_bytes(a) == 0
    nn.functional.cross_entropy(pending_b, y).backward()
    groups_a = {id(g) for g in a.model_state.reductions.reduction_groups.values()}
    groups_b = {id(g) for g in b.model_state.reductions.reduction_groups.values()}
    c = wrap(make_net(2), True)  # one after the other: a fresh model checks its own first step
    ref_c = DDP(make_net(2))
    c_losses = [
        [_step(m, o, *local_batch(s, rank, world)) for s in range(2)]
        for m, o in (
            (c, make_optimizer("sgd", c.parameters())),
            (ref_c, make_optimizer("sgd", ref_c.parameters())),
        )
    ]
    return {
        "a": max_rel_diff(losses[0], losses[2]),
        "b": max_rel_diff(losses[1], losses[3]),
        "c": max_rel_diff(*c_losses),
        "states_apart": a.model_state is not b.model_state and not groups_a & groups_b,
        "only_b_gathered": only_b_gathered,
        "b_idle_after": gathered_bytes(b) == 0 and b.model_state.phase is Phase.IDLE,
    }


def test_two_wrapped_models_in_one_process_keep_their_own_state():
    for r in run_on_ranks(_two_models_worker, 2):
        assert r["a"] < TOL and r["b"] < TOL and r["c"] < TOL, r
        assert r["states_apart"] and r["only_b_gathered"] and r["b_idle_after"], r


# -- nothing pinned on the user's objects ------------------------------------------------------------
def _no_markers_worker(rank, world):
    net = make_net()
    originals = list(net.parameters())
    model = auto_wrap(net, by_class([Block, nn.Linear]))
    _step(model, make_optimizer("sgd", model.parameters()), *local_batch(0, rank, world))
    objects = originals + list(model.parameters()) + list(model.modules())
    return sorted({k for obj in objects for k in vars(obj) if k.startswith("_fsdp")})


def test_wrapping_pins_no_marker_attributes():
    assert run_on_ranks(_no_markers_worker, 2)[0] == []


def test_engine_modules_hold_no_module_level_mutable_state():
    """Module-level names in vistrain/fsdp/ bind constants, functions and classes; the one
    registry (weak maps) and a stateless sentinel are the exceptions; nothing rebinds a global."""
    allowed = {("ownership.py", "_REGISTRY"), ("deferred_init.py", "_TARGET")}
    mutable_calls = {"dict", "list", "set", "defaultdict", "OrderedDict", "WeakKeyDictionary"}
    found = []
    for path in sorted(pathlib.Path(vistrain.fsdp.__file__).parent.glob("*.py")):
        tree = ast.parse(path.read_text())
        found += [f"{path.name}: global" for node in ast.walk(tree) if isinstance(node, ast.Global)]
        for node in tree.body:
            if not isinstance(node, (ast.Assign, ast.AnnAssign)) or node.value is None:
                continue
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names = [t.id for t in targets if isinstance(t, ast.Name)]
            value = node.value
            mutable = isinstance(value, (ast.Dict, ast.List, ast.Set, ast.DictComp, ast.ListComp)) or (
                isinstance(value, ast.Call)
                and getattr(value.func, "id", getattr(value.func, "attr", "")) in mutable_calls
            )
            is_instance = isinstance(value, ast.Call) and getattr(value.func, "id", "").startswith("_")
            found += [
                f"{path.name}: {n}"
                for n in names
                if (mutable or is_instance) and (path.name, n) not in allowed
            ]
    assert found == []


# -- phases and collective errors (pure) ----------------------------------------------------------------
def test_phase_changes_are_checked():
    assert checked_transition(UNIT_TRANSITIONS, Phase.IDLE, Phase.FORWARD, "u", False) is Phase.FORWARD
    assert checked_transition(UNIT_TRANSITIONS, Phase.SUMMONED, Phase.IDLE, "u", False) is Phase.IDLE
    with pytest.raises(RuntimeError, match="unit 'x' cannot go from forward to backward"):
        checked_transition(UNIT_TRANSITIONS, Phase.FORWARD, Phase.BACKWARD, "unit 'x'", False)
    with pytest.raises(RuntimeError, match="cannot go from backward to summoned"):
        checked_transition(UNIT_TRANSITIONS, Phase.BACKWARD, Phase.SUMMONED, "u", False)
    with pytest.raises(RuntimeError, match="cannot go from idle to summoned"):
        checked_transition(MODEL_TRANSITIONS, Phase.IDLE, Phase.SUMMONED, "model", False)
    # recovery after an exception may return to IDLE from anywhere, and only there
    assert checked_transition(UNIT_TRANSITIONS, Phase.FORWARD, Phase.IDLE, "u", True) is Phase.IDLE
    with pytest.raises(RuntimeError):
        checked_transition(UNIT_TRANSITIONS, Phase.BACKWARD, Phase.FORWARD, "u", True)


class _FailingWork:
    def __init__(self, message):
        self.message = message

    def wait(self, timeout=None):
        raise RuntimeError(self.message)


def test_a_failed_collective_is_reported_as_what_it_is():
    cpu, timeout = torch.device("cpu"), datetime.timedelta(seconds=2)
    reset = "[pair.cc:545] Read error [127.0.0.1]:22177: Connection reset by peer"
    with pytest.raises(CollectiveError) as error:
        wait_within(
            _FailingWork(reset), timeout, "the all-gather of flat parameter [blocks.0.conv.weight]", cpu
        )
    assert "the all-gather of flat parameter [blocks.0.conv.weight] failed on this rank" in str(error.value)
    assert "Connection reset by peer" in str(error.value) and "did not complete" not in str(error.value)
    with pytest.raises(CollectiveTimeout, match="did not complete within 2 s on this rank"):
        wait_within(_FailingWork("Operation timed out!"), timeout, "the gradient reduction", cpu)
