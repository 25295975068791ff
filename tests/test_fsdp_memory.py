"""What a rank of the sharded engine holds between steps, in storage bytes, against DDP / N."""

import pytest
import torch
from fsdp_models import local_batch, make_net, make_optimizer, wrap
from torch import nn

from vistrain.distributed.testing import run_on_ranks
from vistrain.fsdp.memory import held_tensors, storage_bytes

# Full-size state tensors per parameter element besides the parameter and its gradient.
STATE_TENSORS = {"sgd": 1, "adamw": 2}  # momentum_buffer; exp_avg, exp_avg_sq


def _steps(model, optimizer, rank, world, steps=2):
    """Train with gradients kept at the end: parameters, gradients and state all persist."""
    for step in range(steps):
        optimizer.zero_grad(set_to_none=False)
        x, y = local_batch(step, rank, world)
        nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()


def _held_worker(rank, world, optim_name):
    plain = make_net()
    plain_opt = make_optimizer(optim_name, plain.parameters())
    _steps(plain, plain_opt, rank, 1)  # what each DDP rank holds (parameters, grads, state)
    out = []
    for reshard in (True, False):
        model = wrap(make_net(), True, reshard_after_forward=reshard)
        optimizer = make_optimizer(optim_name, model.parameters())
        _steps(model, optimizer, rank, world)
        handles = [h for u in model.units() for h in u.unit_state.handles]
        elements = [(h.shard_numel, h.numel, sum(p.numel() for p in h.local_params)) for h in handles]
        # each handle's gradients view one shard-sized tensor of their own
        grad_is_own = all(
            h.local_params[0].grad.untyped_storage().nbytes() == h.shard_numel * 4 for h in handles
        )
        out.append(
            {
                "reshard": reshard,
                "ours": storage_bytes(held_tensors(model, optimizer)),
                "ddp": storage_bytes(held_tensors(plain, plain_opt)),
                "shards": elements,
                "n_plain": len(list(plain.parameters())),
                "grad_is_own": grad_is_own,
            }
        )
    return out


@pytest.mark.parametrize("world", [2, 3, 4])
@pytest.mark.parametrize("optim_name", ["sgd", "adamw"])
def test_held_storage_bytes_are_ddp_over_n_plus_padding(world, optim_name):
    """Parameters + gradients + optimizer state + engine buffers == DDP's / N + padding, per rank.

    Per flat shard of ``s`` elements holding ``n`` real ones, ``local`` of them on this rank, a
    rank keeps ``s - n / N`` more elements than DDP / N in the shard (the local parameters view
    it) and in their gradients (views of one shard-sized tensor), and ``local - n / N`` more in
    each optimizer state tensor (per parameter: no padding). AdamW's per-parameter ``step``
    scalars are the only other difference.
    """
    for rank_results in run_on_ranks(_held_worker, world, optim_name):
        for r in rank_results:
            assert r["grad_is_own"], "a shard gradient is a view into a larger buffer"
            state_elem = 4 * STATE_TENSORS[optim_name]
            padding = sum(
                (s - n / world) * 8 + (local - n / world) * state_elem for s, n, local in r["shards"]
            )
            scalars = 4 * r["n_plain"] if optim_name == "adamw" else 0
            excess = r["ours"] - r["ddp"] / world
            assert abs(excess - padding) <= scalars + 1e-6, (r["reshard"], r["ours"], r["ddp"] / world)


def _no_full_buffer_worker(rank, world):
    """During backward, at most two units' full gradients are alive at once."""
    model = wrap(make_net(), True)
    optimizer = make_optimizer("sgd", model.parameters())
    _steps(model, optimizer, rank, world, steps=1)  # execution order known from now on
    reductions = model.model_state.reductions
    most = []
    for unit in model.model_state.units:
        for handle in unit.handles:
            handle.full.register_post_accumulate_grad_hook(lambda _: most.append(len(reductions.pending)))
    x, y = local_batch(1, rank, world)
    nn.functional.cross_entropy(model(x), y).backward()
    return max(most), len(reductions.pending)


def test_reductions_do_not_pile_up_during_backward():
    for in_flight_before_hook, left in run_on_ranks(_no_full_buffer_worker, 2):
        # hooks registered after the engine's run after it: the unit's own reduction is in flight
        assert in_flight_before_hook == 1 and left == 0


def test_storage_bytes_counts_whole_storages_once():
    base = torch.zeros(100)
    assert storage_bytes([base[:10], base[10:20]]) == 400
    assert storage_bytes([base[:10].clone(), torch.empty(3, device="meta")]) == 40
