"""The sharded engine against DDP on real gloo processes, plus its pure rank arithmetic."""

import itertools
import math

import pytest
import torch
import torch.distributed as dist
from fsdp_models import (
    Block,
    Net,
    ddp_reference,
    local_batch,
    make_net,
    make_optimizer,
    max_rel_diff,
    train,
    wrap,
)
from torch import nn
from torch.utils.checkpoint import checkpoint

from vistrain.distributed.testing import run_on_ranks
from vistrain.fsdp import FullyShardedDataParallel as FSDP
from vistrain.fsdp import (
    Precision,
    ShardedGradScaler,
    auto_wrap,
    by_class,
    gathered,
    origin_sq_norms,
    params_of,
)
from vistrain.fsdp.backends import local_part
from vistrain.fsdp.flat_param import (
    ParamOrigin,
    flat_layout,
    local_shape,
    row_size,
    shard_range,
    shard_size,
    shard_slices,
)

TOL = 1e-5


# -- pure rank arithmetic ---------------------------------------------------------------------
@pytest.mark.parametrize("numel", [1, 2, 7, 135, 1000, 1001])
@pytest.mark.parametrize("world", [1, 2, 3, 4, 5, 8])
def test_shards_cover_every_element_once(numel, world):
    size = shard_size(numel, world)
    assert size == -(-numel // world)
    ranges = [shard_range(numel, world, r) for r in range(world)]
    assert ranges[0][0] == 0 and all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))
    assert ranges[-1][1] >= numel and ranges[-1][1] - numel < world


@pytest.mark.parametrize("world", [1, 2, 3, 4, 5, 8])
@pytest.mark.parametrize(
    "shapes",
    [
        [(5, 3), (7,), (1,), (2, 2, 3)],
        [(7, 7)],
        [(10, 7), (5,), (9, 3, 3, 3)],
        [(30, 256), (3000,), (40, 64), ()],
        [(104, 48, 1, 1), (216, 24, 3, 3), (440, 216, 1, 1), (5,)],
    ],
)
def test_layout_covers_every_element_once_in_whole_rows(world, shapes):
    """Every element on exactly one rank; each rank's part of a parameter is whole rows
    (so its local parameter keeps the trailing dims), padding small."""
    offsets, shard = flat_layout([torch.Size(s) for s in shapes], world)
    origins = [
        ParamOrigin(f"p{i}", None, f"p{i}", torch.Size(s), o) for i, (s, o) in enumerate(zip(shapes, offsets))
    ]
    assert all(a.flat_offset + a.numel <= b.flat_offset for a, b in zip(origins, origins[1:]))
    assert origins[-1].flat_offset + origins[-1].numel <= shard * world
    total = sum(o.numel for o in origins)
    assert shard * world - total < max(total // 16, 4096) + 2 * world * (1 + max(row_size(s) for s in shapes))
    covered = [torch.zeros(o.numel) for o in origins]
    for rank in range(world):
        for idx, s_start, p_start, length in shard_slices(origins, shard, rank):
            assert s_start >= 0 and s_start + length <= shard
            covered[idx][p_start : p_start + length] += 1
            shape = local_shape(origins[idx].shape, p_start, length)
            assert math.prod(shape) == length
            if len(shapes[idx]) >= 2:  # no fallback here: every layout is row-aligned
                assert shape[1:] == tuple(shapes[idx][1:]), (shapes[idx], shape)
    assert all(bool((c == 1).all()) for c in covered)


def test_layout_falls_back_to_1d_parts_where_rows_would_cost_too_much():
    """Two big parameters spanning several boundaries whose rows have a large lcm: still every
    element once, padding bounded; parts the layout could not cut between rows are 1-D."""
    shapes = [torch.Size(s) for s in [(4001, 997), (3001, 991), (3, 2048), (216, 24, 3, 3), (440, 208, 1, 1)]]
    offsets, shard = flat_layout(shapes, 8)
    origins = [ParamOrigin(f"p{i}", None, f"p{i}", s, o) for i, (s, o) in enumerate(zip(shapes, offsets))]
    total = sum(o.numel for o in origins)
    assert shard * 8 - total < total // 16
    covered = [torch.zeros(o.numel) for o in origins]
    for rank in range(8):
        for idx, _, p_start, length in shard_slices(origins, shard, rank):
            covered[idx][p_start : p_start + length] += 1
            assert math.prod(local_shape(origins[idx].shape, p_start, length)) == length
    assert all(bool((c == 1).all()) for c in covered)


# -- parity with DDP --------------------------------------------------------------------------
def _parity_worker(rank, world):
    results = {}
    for optim_name in ("sgd", "adamw"):
        ref_losses, ref_state = ddp_reference(optim_name, rank, world)
        for nested, reshard in itertools.product((False, True), (True, False)):
            model = wrap(make_net(), nested, reshard_after_forward=reshard)
            optimizer = make_optimizer(optim_name, model.parameters())
            losses = train(model, optimizer, rank, world)
            results[(optim_name, nested, reshard)] = (
                max_rel_diff(losses, ref_losses),
                max_rel_diff(model.state_dict(), ref_state),
            )
    wrapped = wrap(make_net(), True)
    shard_numels = [h.shard.numel() for u in wrapped.units() for h in u.unit_state.handles]
    held = sum(p.numel() for p in wrapped.parameters())  # the local parameters: this rank's elements
    return results, (shard_numels, held)


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_losses_and_weights_equal_ddp(world):
    outputs = run_on_ranks(_parity_worker, world)
    for key, (loss_diff, state_diff) in outputs[0][0].items():
        assert loss_diff < TOL and state_diff < TOL, (key, loss_diff, state_diff)
    # Every rank holds ceil(n / world) elements of each flat parameter (plus less than a row
    # per parameter a rank boundary cuts), and the local parameters together hold every element once.
    units = wrap_sizes()
    expected = [-(-n // world) for n in units]
    for _, (shard_numels, _) in outputs:
        assert all(0 <= got - want <= 64 for got, want in zip(sorted(shard_numels), sorted(expected)))
    assert sum(held for _, (_, held) in outputs) == sum(units)


def wrap_sizes():
    """Flat sizes of the nested wrapping of Net: one per Block, Linear and the root's stem."""
    net = Net()
    sizes = [sum(p.numel() for p in b.parameters()) for b in net.blocks]
    sizes += [sum(p.numel() for p in net.head.parameters()), sum(p.numel() for p in net.twice.parameters())]
    sizes.append(sum(p.numel() for p in net.stem.parameters()))
    return sizes


def _features_worker(rank, world):
    out = {}
    ref_losses, ref_state = ddp_reference("sgd", rank, world, clip=0.05)
    model = wrap(make_net(), True)
    losses = train(model, make_optimizer("sgd", model.parameters()), rank, world, clip=0.05)
    out["clip"] = (max_rel_diff(losses, ref_losses), max_rel_diff(model.state_dict(), ref_state))

    ref = ddp_reference("sgd", rank, world)[0]
    model = wrap(make_net(), True, flatten_parameters=False)
    out["unflattened"] = max_rel_diff(
        train(model, make_optimizer("sgd", model.parameters()), rank, world), ref
    )

    # On a CPU-only machine the compute device is the CPU too: this checks the offload
    # bookkeeping (shard device, gradient copies), not the transfer speed.
    model = wrap(make_net(), True, move_params_to_cpu=True)
    out["offload"] = max_rel_diff(train(model, make_optimizer("sgd", model.parameters()), rank, world), ref)

    model = wrap(make_net(), True, precision=Precision(torch.bfloat16, torch.float32))
    out["bf16"] = max_rel_diff(train(model, make_optimizer("sgd", model.parameters()), rank, world), ref)
    out["bf16_master_dtype"] = {p.dtype for p in model.parameters()} == {torch.float32}
    return out


def test_clipping_unflattened_and_bf16_track_ddp():
    out = run_on_ranks(_features_worker, 3)[0]
    assert out["clip"][0] < TOL and out["clip"][1] < TOL, out["clip"]
    assert out["unflattened"] < TOL and out["offload"] < TOL
    assert out["bf16"] < 2e-2 and out["bf16_master_dtype"]


def _no_sync_worker(rank, world):
    """Two micro-batches (one under no_sync) equal one step on their concatenation."""
    model = wrap(make_net(), True)
    optimizer = make_optimizer("sgd", model.parameters())
    x, y = local_batch(0, rank, world, per_rank=8)
    with model.no_sync():
        (nn.functional.cross_entropy(model(x[:4]), y[:4]) / 2).backward()
    (nn.functional.cross_entropy(model(x[4:]), y[4:]) / 2).backward()
    optimizer.step()

    ref = torch.nn.parallel.DistributedDataParallel(make_net())
    ref_opt = make_optimizer("sgd", ref.parameters())
    nn.functional.cross_entropy(ref(x), y).backward()
    ref_opt.step()
    return max_rel_diff(model.state_dict(), ref.module.state_dict())


def test_no_sync_accumulation_equals_big_batch():
    assert max(run_on_ranks(_no_sync_worker, 2)) < TOL


class CheckpointedBlock(Block):
    def forward(self, x):
        return checkpoint(super().forward, x, use_reentrant=False)


class FrozenStemNet(Net):
    def __init__(self):
        super().__init__()
        self.stem.requires_grad_(False)
        self.blocks = nn.Sequential(CheckpointedBlock(5), CheckpointedBlock(5))


def _frozen_checkpointed_worker(rank, world):
    torch.manual_seed(0)
    plain = FrozenStemNet()
    reference = FrozenStemNet()
    reference.load_state_dict(plain.state_dict())
    ddp = torch.nn.parallel.DistributedDataParallel(reference)
    ref_losses = train(
        ddp, make_optimizer("sgd", [p for p in ddp.parameters() if p.requires_grad]), rank, world
    )
    model = auto_wrap(plain, by_class([CheckpointedBlock, nn.Linear]))
    trainable = [p for p in model.parameters() if p.requires_grad]
    losses = train(model, make_optimizer("sgd", trainable), rank, world)
    frozen_unchanged = torch.equal(model.state_dict()["stem.weight"], ddp.module.stem.weight)
    return (
        max_rel_diff(losses, ref_losses),
        max_rel_diff(model.state_dict(), ddp.module.state_dict()),
        len(trainable) < len(list(model.parameters())),
        frozen_unchanged,
    )


def test_frozen_parameters_and_activation_checkpointing_equal_ddp():
    loss_diff, state_diff, has_frozen_shards, frozen_unchanged = run_on_ranks(_frozen_checkpointed_worker, 2)[
        0
    ]
    assert loss_diff < TOL and state_diff < TOL and has_frozen_shards and frozen_unchanged


def _state_dict_worker(rank, world):
    model = wrap(make_net(seed=0), True)
    train(model, make_optimizer("sgd", model.parameters()), rank, world, steps=2)
    full = model.state_dict()
    plain = make_net(seed=5)
    plain.load_state_dict(full)  # loads into the unwrapped module with strict keys
    x, _ = local_batch(0, rank, world)
    with torch.no_grad():
        same_output = torch.allclose(plain(x), model(x), atol=1e-6)

    other = wrap(make_net(seed=7), True)
    other.load_state_dict(full)
    full_roundtrip = max_rel_diff(other.state_dict(), full)

    with model.summon_full_params():
        model.module.head.weight.data.fill_(0.5)  # writable, written back to the shards
    written = bool((model.state_dict()["head.weight"] == 0.5).all())
    with pytest.raises(RuntimeError, match="missing keys"):
        other.load_state_dict({k: v for k, v in full.items() if k != "head.bias"})
    bad = dict(full, **{"head.bias": torch.zeros(3)})
    with pytest.raises(RuntimeError, match="head.bias: shape"):
        other.load_state_dict(bad)
    return (
        sorted(full) == sorted(make_net().state_dict()),
        same_output,
        full_roundtrip,
        written,
    )


def test_full_state_dicts_round_trip():
    for same_keys, same_output, full_rt, written in run_on_ranks(_state_dict_worker, 3):
        assert same_keys and same_output and full_rt == 0 and written


def _norms_worker(rank, world):
    """Per-original-parameter norms from shards equal those of the full tensors."""
    model = wrap(make_net(), True)
    params = list(model.parameters())
    norms = origin_sq_norms(params, [p.detach() for p in params])
    reference = {k: v.pow(2).sum() for k, v in make_net().state_dict().items()}
    worst = 0.0
    for p, n in zip(params, norms):
        part = local_part(p)
        if part.length:
            expect = reference[part.origin.fqn]
            worst = max(worst, (n - expect).abs().max().item() / expect.item())
    return worst


def test_per_parameter_norms_across_shards():
    assert max(run_on_ranks(_norms_worker, 3)) < 1e-6


def _scaler_worker(rank, world):
    model = wrap(make_net(), True)
    optimizer = make_optimizer("sgd", model.parameters())
    scaler = ShardedGradScaler("cpu", init_scale=4.0)
    x, y = local_batch(0, rank, world)
    scaler.scale(nn.functional.cross_entropy(model(x), y)).backward()
    if rank == 1:  # an overflow only this rank can see
        next(iter(model.parameters())).grad[0] = float("inf")
    before = [p.detach().clone() for p in model.parameters()]
    scaler.step(optimizer)
    scaler.update()
    unchanged = all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    return unchanged, scaler.get_scale()


def test_sharded_grad_scaler_skips_the_step_on_every_rank():
    for unchanged, scale in run_on_ranks(_scaler_worker, 2):
        assert unchanged and scale == 2.0


def _misuse_worker(rank, world):
    errors = []
    net = make_net()
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
    model = FSDP(net)
    try:
        FSDP(model)
    except ValueError as e:
        errors.append(str(e))
    x, y = local_batch(0, rank, world)
    nn.functional.cross_entropy(model(x), y).backward()
    try:
        optimizer.step()
    except RuntimeError as e:
        errors.append(str(e))
    head = auto_wrap(make_net(), by_class([nn.Linear])).module.head
    names = [name for name, _ in head.named_parameters()]
    with gathered(make_net()):  # plain modules: a no-op context
        pass
    return errors, (len(params_of(head)), names)


def test_misuse_errors():
    errors, n_head_params = run_on_ranks(_misuse_worker, 2)[0]
    assert "wrapping twice" in errors[0]
    assert "after wrapping" in errors[1]
    assert n_head_params == (2, ["weight", "bias"])  # the original parameters, not one flat shard


def test_uninitialised_process_group_is_an_error():
    assert not dist.is_initialized()
    with pytest.raises(RuntimeError, match="initialised process group"):
        FSDP(make_net())


def _fp32_child_worker(rank, world):
    """A full-precision unit inside a bf16 parent gets fp32 weights and fp32 inputs."""
    seen = []
    model = make_net()
    model.head.register_forward_hook(lambda m, i, o: seen.append((i[0].dtype, m.weight.dtype)))
    model.head = FSDP(model.head)
    model = FSDP(model, precision=Precision(torch.bfloat16))
    x, y = local_batch(0, rank, world)
    nn.functional.cross_entropy(model(x).float(), y).backward()
    return seen


def test_full_precision_unit_inside_mixed_precision_parent():
    assert set(run_on_ranks(_fp32_child_worker, 2)[0]) == {(torch.float32, torch.float32)}
