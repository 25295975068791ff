"""The sharded engine off the happy path, each case against DDP on real gloo processes.

Interrupted backward, outputs in any container, intermediates kept on ``self``, namedtuples under
mixed precision, skipped prefetches, BatchNorm buffers, units unused on some ranks, ranks that
run different units, and collectives that would otherwise wait forever.
"""

import dataclasses
import datetime
import warnings
from collections import namedtuple

import torch
import torch.distributed as dist
from fsdp_models import Block, Net, gathered_bytes, local_batch, make_optimizer, max_rel_diff
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from vistrain.distributed.testing import run_on_ranks
from vistrain.fsdp import FullyShardedDataParallel as FSDP
from vistrain.fsdp import Precision, RootOptions, auto_wrap, by_class
from vistrain.fsdp.unit import Phase

TOL = 1e-5


def _reference_and_sharded(make, rank, world, run, **options):
    """(DDP result, DDP state dict, sharded result, sharded state dict) of ``run(model, optimizer)``
    on two identical models; the sharded one has a unit per Block and Linear. ``options``: DDP's
    (``broadcast_buffers``, ``find_unused_parameters``), the sharded root's of the same name."""
    ref = DDP(make(), **options)
    ref_out = run(ref, make_optimizer("sgd", ref.parameters()))
    model = auto_wrap(make(), by_class([Block, nn.Linear]), root=RootOptions(**options))
    out = run(model, make_optimizer("sgd", model.parameters()))
    return ref_out, ref.module.state_dict(), out, model.state_dict()


# -- an exception inside backward, caught by the loop ------------------------------------------
class Explode(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        raise FloatingPointError("injected failure in backward")


class ExplodingNet(Net):
    """Raises in backward between its two blocks (after later units reduced) when ``explode``."""

    explode = False

    def forward(self, x):
        x = self.blocks[0](self.stem(x))
        x = Explode.apply(x) if self.explode else x
        x = self.head(self.blocks[1](x).mean((2, 3)))
        return self.twice(torch.relu(self.twice(x)))


def _make_exploding():
    torch.manual_seed(0)
    return ExplodingNet()


def _train_with_failure(rank, world, recover_with, skip_failed_step):
    """Four SGD steps; step 1 raises in backward (sharded) or is skipped (the DDP reference)."""

    def run(model, optimizer):
        inner = model.module
        losses = []
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for step in range(4):
                inner.explode = step == 1
                if inner.explode and skip_failed_step:
                    continue
                x, y = local_batch(step, rank, world)
                try:
                    loss = nn.functional.cross_entropy(model(x), y)
                    loss.backward()
                except FloatingPointError:
                    optimizer.zero_grad(set_to_none=True)
                    if recover_with == "state_dict":
                        model.state_dict()
                    elif recover_with == "reset":
                        model.reset_iter_state()
                    continue  # "forward": the next forward recovers
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                losses.append(loss.item())
        return losses, [str(w.message) for w in caught]

    return run


def _exception_worker(rank, world):
    ddp = DDP(_make_exploding())
    ref_losses, _ = _train_with_failure(rank, world, None, True)(ddp, make_optimizer("sgd", ddp.parameters()))
    results = {}
    for recover_with in ("forward", "state_dict", "reset"):
        model = auto_wrap(_make_exploding(), by_class([Block, nn.Linear]))
        losses, warned = _train_with_failure(rank, world, recover_with, False)(
            model, make_optimizer("sgd", model.parameters())
        )
        idle = model.model_state.phase is Phase.IDLE and not model.model_state.reductions.pending
        results[recover_with] = (
            max_rel_diff(losses, ref_losses),
            max_rel_diff(model.state_dict(), ddp.module.state_dict()),
            warned,
            idle,
            gathered_bytes(model),
        )
    return results


def test_failed_backward_is_discarded_and_training_goes_on():
    """Recovery by the next forward, by state_dict() or by reset_iter_state() equals DDP
    skipping the failed step."""
    for results in run_on_ranks(_exception_worker, 2):
        for recover_with, (loss_diff, state_diff, warned, idle, still_gathered) in results.items():
            assert loss_diff < TOL and state_diff < TOL, (recover_with, loss_diff, state_diff)
            assert idle and still_gathered == 0, recover_with
            if recover_with != "reset":  # implicit recovery says so; the explicit one is silent
                assert len(warned) == 1 and "previous backward did not finish" in warned[0], warned


# -- outputs in any container, intermediates kept on self, namedtuples under mixed precision ----
Pair = namedtuple("Pair", "main skip")


@dataclasses.dataclass
class Features:
    out: torch.Tensor
    pooled: torch.Tensor


class PairBlock(nn.Module):
    """Takes and returns a namedtuple."""

    def __init__(self, channels=5):
        super().__init__()
        self.conv = nn.Conv2d(channels, channels, 3, padding=1)

    def forward(self, pair):
        return Pair(pair.main + self.conv(torch.relu(pair.main)), pair.skip)


class FeatureBlock(nn.Module):
    """Returns a dataclass."""

    def __init__(self, channels=5):
        super().__init__()
        self.conv = nn.Conv2d(channels, channels, 1)

    def forward(self, x):
        out = self.conv(x)
        return Features(out, out.mean((2, 3)))


class StashingHead(nn.Module):
    """Keeps an intermediate on ``self`` that the loss reads (as some SSL heads do)."""

    def __init__(self, channels=5, classes=7):
        super().__init__()
        self.fc = nn.Linear(channels, classes)
        self.aux = nn.Linear(channels, 3)

    def forward(self, x):
        self.stash = self.aux(x)
        return self.fc(x)


class ContainerNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.stem = nn.Conv2d(3, 5, 3, padding=1)
        self.pair = PairBlock()
        self.features = FeatureBlock()
        self.head = StashingHead()

    def forward(self, x):
        pair = self.pair(Pair(self.stem(x), x))
        feats = self.features(pair.main)
        return self.head(feats.pooled + pair.skip.mean((1, 2, 3))[:, None])


def _make_container_net():
    torch.manual_seed(0)
    return ContainerNet()


def _container_loss(model, x, y):
    out = model(x)
    stash = next(m.__dict__["stash"] for m in model.modules() if "stash" in m.__dict__)
    return nn.functional.cross_entropy(out.float(), y) + stash.float().pow(2).mean()


def _run_steps(rank, world, loss_fn, steps=4):
    def run(model, optimizer):
        losses = []
        for step in range(steps):
            x, y = local_batch(step, rank, world)
            loss = loss_fn(model, x, y)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            losses.append(loss.item())
        return losses

    return run


def _container_worker(rank, world):
    policy = by_class([PairBlock, FeatureBlock, StashingHead])
    ddp = DDP(_make_container_net())
    run = _run_steps(rank, world, _container_loss)
    ref_losses = run(ddp, make_optimizer("sgd", ddp.parameters()))
    ref_state = ddp.module.state_dict()
    out = {}
    for name, kwargs in {
        "nested": dict(wrap=True),
        "flat": dict(wrap=False),
        "nested_bf16": dict(wrap=True, precision=Precision(torch.bfloat16)),
    }.items():
        nested = kwargs.pop("wrap")
        model = auto_wrap(_make_container_net(), policy if nested else (lambda m: None), **kwargs)
        losses = run(model, make_optimizer("sgd", model.parameters()))
        out[name] = (max_rel_diff(losses, ref_losses), max_rel_diff(model.state_dict(), ref_state))
    return out


def test_dataclass_namedtuple_outputs_and_intermediates_on_self_equal_ddp():
    for out in run_on_ranks(_container_worker, 2):
        for name in ("nested", "flat"):
            assert out[name][0] < TOL and out[name][1] < TOL, (name, out[name])
        assert out["nested_bf16"][0] < 2e-2 and out["nested_bf16"][1] < 2e-2, out["nested_bf16"]


# -- a unit prefetched but skipped -------------------------------------------------------------
class SkippingNet(Net):
    """From the second step on, skips its second block (same on every rank)."""

    skip = False

    def forward(self, x):
        x = self.blocks[0](self.stem(x))
        x = x if self.skip else self.blocks[1](x)
        return self.twice(torch.relu(self.twice(self.head(x.mean((2, 3))))))


def _make_skipping():
    torch.manual_seed(0)
    return SkippingNet()


def _skip_worker(rank, world):
    def run(model, optimizer):
        losses, leftover = [], []
        for step in range(4):
            model.module.skip = step > 0  # step 0 fixes the order that prefetches follow
            x, y = local_batch(step, rank, world)
            loss = nn.functional.cross_entropy(model(x), y)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            losses.append(loss.item())
            leftover.append(gathered_bytes(model) if isinstance(model, FSDP) else 0)
        return losses, leftover

    ref, ref_state, (losses, leftover), state = _reference_and_sharded(
        _make_skipping, rank, world, run, find_unused_parameters=True
    )
    return max_rel_diff(losses, ref[0]), max_rel_diff(state, ref_state), leftover


def test_skipped_prefetched_unit_frees_its_weights():
    for loss_diff, state_diff, leftover in run_on_ranks(_skip_worker, 2):
        assert loss_diff < TOL and state_diff < TOL
        assert leftover == [0, 0, 0, 0], leftover  # nothing stays gathered between steps


# -- BatchNorm buffers -------------------------------------------------------------------------
class NormBlock(Block):
    def __init__(self, channels):
        super().__init__(channels)
        self.bn = nn.BatchNorm2d(channels)

    def forward(self, x):
        return self.bn(super().forward(x))


def _make_bn_net():
    torch.manual_seed(0)
    net = Net()
    net.blocks = nn.Sequential(NormBlock(5), NormBlock(5))
    return net


def _buffers_worker(rank, world):
    def run(model, optimizer):
        return _run_steps(rank, world, lambda m, x, y: nn.functional.cross_entropy(m(x), y), steps=3)(
            model, optimizer
        )

    out = {}
    for broadcast in (True, False):
        ref, ref_state, losses, state = _reference_and_sharded(
            _make_bn_net, rank, world, run, broadcast_buffers=broadcast
        )
        out[broadcast] = (max_rel_diff(losses, ref), max_rel_diff(state, ref_state))
    return out


def test_buffers_follow_ddp_broadcast_semantics():
    """Per rank, running statistics equal DDP's with and without ``broadcast_buffers``."""
    for per_rank in run_on_ranks(_buffers_worker, 2):
        for broadcast, (loss_diff, state_diff) in per_rank.items():
            assert loss_diff < TOL and state_diff < TOL, (broadcast, loss_diff, state_diff)


# -- ranks that run different units ------------------------------------------------------------
class RankDependentNet(Net):
    """``swap``: the two same-size blocks run in a rank-dependent order; ``branch``: the second
    block runs on rank 0 only."""

    mode = "swap"

    def forward(self, x):
        x = self.stem(x)
        blocks = list(self.blocks)
        if self.mode == "swap" and dist.get_rank() == 1:
            blocks.reverse()
        if self.mode == "branch" and dist.get_rank() == 1:
            blocks = blocks[:1]
        for block in blocks:
            x = block(x)
        return self.twice(torch.relu(self.twice(self.head(x.mean((2, 3))))))


def _disagreement_worker(rank, world):
    errors = {}
    for mode in ("swap", "branch"):
        torch.manual_seed(0)
        net = RankDependentNet()
        net.mode = mode
        model = auto_wrap(net, by_class([Block, nn.Linear]))
        x, y = local_batch(0, rank, world)
        try:
            nn.functional.cross_entropy(model(x), y).backward()
        except RuntimeError as error:
            errors[mode] = str(error)
    return errors


def test_ranks_running_different_units_fail_on_every_rank_at_the_first_step():
    for errors in run_on_ranks(_disagreement_worker, 2):
        assert "at unit call 1: rank 0 ran 'blocks.0', rank 1 ran 'blocks.1'" in errors["swap"], errors
        assert "at unit call 2: rank 0 ran 'blocks.1', rank 1 ran 'head'" in errors["branch"], errors


# -- an output that feeds the loss on some ranks only ------------------------------------------
class SideOutputNet(Net):
    def __init__(self):
        super().__init__()
        self.side = nn.Linear(5, 2)

    def forward(self, x):
        feats = self.blocks(self.stem(x)).mean((2, 3))
        return self.twice(torch.relu(self.twice(self.head(feats)))), self.side(feats)


def _make_side_net():
    torch.manual_seed(0)
    return SideOutputNet()


def _side_loss(model, x, y):
    out, side = model(x)
    loss = nn.functional.cross_entropy(out, y)
    return loss + side.pow(2).mean() if dist.get_rank() == 0 else loss


def _unused_worker(rank, world):
    run = _run_steps(rank, world, _side_loss, steps=3)
    ref, ref_state, losses, state = _reference_and_sharded(
        _make_side_net, rank, world, run, find_unused_parameters=True
    )
    parity = (max_rel_diff(losses, ref), max_rel_diff(state, ref_state))
    # Without the option the ranks' backward collectives would not match: the first step's
    # check stops every rank before the mismatched collective is issued.
    model = auto_wrap(_make_side_net(), by_class([Block, nn.Linear]))
    try:
        run(model, make_optimizer("sgd", model.parameters()))
        error = None
    except RuntimeError as e:
        error = str(e)
    return parity, error


def test_outputs_unused_on_some_ranks_need_find_unused_parameters_and_never_hang():
    results = run_on_ranks(_unused_worker, 2)
    for (loss_diff, state_diff), _ in results:
        assert loss_diff < TOL and state_diff < TOL, (loss_diff, state_diff)
    for _, error in results:  # every rank raised the same error instead of hanging
        assert "ranks ran the backward of different units" in error, error
        assert "rank 0 ran 'side'" in error and "needs find_unused_parameters=True" in error, error


MISSING_PEER_TIMEOUT = 10.0


def _missing_peer_worker(rank, world):
    """After the first step rank 1 skips a backward: rank 0's backward collectives have no peer."""
    side = dist.new_group(timeout=datetime.timedelta(seconds=120))  # to meet again afterwards
    torch.manual_seed(0)
    # far above a healthy collective even on a loaded machine; the missing peer's wait ends at it
    model = auto_wrap(
        Net(), by_class([Block, nn.Linear]), root=RootOptions(collective_timeout=MISSING_PEER_TIMEOUT)
    )
    error = None
    for step in range(2):
        x, y = local_batch(step, rank, world)
        loss = nn.functional.cross_entropy(model(x), y)
        if step == 1 and rank == 1:
            break  # e.g. a rank that skips a step on a non-finite loss
        try:
            loss.backward()
        except RuntimeError as e:
            error = str(e)
    dist.barrier(group=side)
    return error


def test_a_collective_without_peers_fails_within_the_timeout():
    error, peer_error = run_on_ranks(_missing_peer_worker, 2)
    assert peer_error is None
    assert f"did not complete within {MISSING_PEER_TIMEOUT:g} s on this rank" in error, error
    assert "Ranks probably ran different units" in error


# -- tied parameters, one submodule under two names ---------------------------------------------
class Coder(nn.Module):
    def __init__(self, width=6):
        super().__init__()
        self.inner = nn.Linear(width, width)
        self.tied = nn.Linear(width, width, bias=False)

    def forward(self, x):
        return self.tied(torch.tanh(self.inner(x)))


class TiedNet(nn.Module):
    """Encoder and decoder share one weight (as embedding and output projection often do); the
    same block is also reachable under a second name, ``again``."""

    def __init__(self):
        super().__init__()
        self.encoder, self.decoder = Coder(), Coder()
        self.decoder.tied.weight = self.encoder.tied.weight
        self.block = nn.Linear(6, 6)
        self.again = self.block
        self.out = nn.Linear(6, 7)

    def forward(self, x):
        x = self.again(torch.relu(self.block(self.encoder(x.mean((2, 3)).repeat(1, 2)))))
        return self.out(self.decoder(x))


def _make_tied():
    torch.manual_seed(0)
    return TiedNet()


def _tied_worker(rank, world):
    run = _run_steps(rank, world, lambda m, x, y: nn.functional.cross_entropy(m(x), y))
    ref = DDP(_make_tied())
    ref_losses = run(ref, make_optimizer("sgd", ref.parameters()))
    model = auto_wrap(_make_tied(), by_class([Coder, nn.Linear]))
    losses = run(model, make_optimizer("sgd", model.parameters()))
    state = model.state_dict()
    plain = TiedNet()
    plain.load_state_dict(state)
    tie_kept = plain.decoder.tied.weight is plain.encoder.tied.weight
    errors = []
    for wrap_by_hand in (_split_tie_by_hand, _wrap_one_name_by_hand):
        try:
            wrap_by_hand()
        except ValueError as error:
            errors.append(str(error))
    return (
        max_rel_diff(losses, ref_losses),
        max_rel_diff(state, ref.module.state_dict()),
        sorted(state) == sorted(TiedNet().state_dict()),
        torch.equal(state["encoder.tied.weight"], state["decoder.tied.weight"]) and tie_kept,
        errors,
    )


def _split_tie_by_hand():
    net = _make_tied()
    net.encoder = FSDP(net.encoder)  # takes the tied weight, which the decoder also uses
    FSDP(net)


def _wrap_one_name_by_hand():
    net = _make_tied()
    net.block = FSDP(net.block)  # ``again`` still refers to the unwrapped module
    FSDP(net)


def test_tied_parameters_and_shared_submodules_equal_ddp():
    for loss_diff, state_diff, same_keys, tied, errors in run_on_ranks(_tied_worker, 2):
        assert loss_diff < TOL and state_diff < TOL, (loss_diff, state_diff)
        assert same_keys and tied
        assert "parameter decoder.tied.weight is tied to tied.weight" in errors[0], errors
        assert "module again (Linear) is already inside a sharded unit" in errors[1], errors
