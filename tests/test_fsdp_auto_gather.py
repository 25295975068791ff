"""Units that gather around their public methods without registration (``gather_public_methods``,
``vistrain/fsdp/forward_methods.py``, ``vistrain/fsdp/gathered_writes.py``).

A timm-like trunk called by name (``forward_features``, ``forward_head``, ``encode``, and a method
calling back into its own unit) trains as under DDP on 2 gloo ranks, ZeRO-3 and ZeRO-2: the same
losses, gradients, weights and features, with in-place writes into the gathered weights (tracked,
through ``.data``, by ``.data =``, SwAV's row normalisation followed by a use with gradients in
the same call) landing in the shards. A re-entrant call gathers once and frees nothing early; a
write into low-precision gathered weights stops on one line naming the method; ``nn.Module``'s
own methods are not gathered; the config key reaches every unit; with the option off an
unregistered method still stops as before. One process group serves the whole module.
"""

import pytest
import torch
from fsdp_models import TokenBlock, max_rel_diff
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from vistrain.distributed.testing import run_on_ranks
from vistrain.fsdp import (
    FULL_PRECISION,
    GatheredWriteError,
    Precision,
    UnregisteredMethodError,
    auto_wrap,
    by_class,
    keep_on_shards,
    local_part,
)
from vistrain.fsdp.forward_methods import gathers_by_itself
from vistrain.methods import build_model, load_config
from vistrain.runtime.sharding import shard_model

STEPS = 3
TOKENS, KEEP, IN, WIDTH, OUT = 6, 3, 8, 16, 5


class Trunk(nn.Module):
    """timm's habits on tokens (N, T, IN): ``forward`` is ``forward_head(forward_features(x))``,
    ``encode`` keeps some tokens (an MAE encoder), ``refine`` calls back into the unit ``via``
    (this module's own unit under the engine, itself under DDP)."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Linear(IN, WIDTH)
        self.pos = nn.Parameter(torch.randn(1, TOKENS, WIDTH) * 0.1)
        self.cls = nn.Parameter(torch.randn(1, 1, WIDTH) * 0.1)
        self.blocks = nn.ModuleList([TokenBlock(WIDTH), TokenBlock(WIDTH)])
        self.norm = nn.LayerNorm(WIDTH)
        self.head = nn.Linear(WIDTH, OUT)

    @property
    def width(self):
        return WIDTH

    @staticmethod
    def tokens_of(x):
        return x.shape[1]

    def forward(self, tokens):
        return self.forward_head(self.forward_features(tokens))

    def forward_features(self, tokens):
        return self.encode(tokens, None)

    def encode(self, tokens, keep):
        x = self.embed(tokens) + self.pos
        if keep is not None:
            x = x.gather(1, keep[..., None].expand(-1, -1, WIDTH))
        x = torch.cat([self.cls.expand(x.shape[0], -1, -1), x], 1)
        for block in self.blocks:
            x = block(x)
        return self.norm(x)

    def forward_head(self, features):
        return self.head(features[:, 0])

    def refine(self, tokens, via):
        """The unit's forward and two more of its gathered methods from inside one, then this
        module's own weights again (freed early, they would be this rank's shards)."""
        again = via.forward_head(via.forward_features(tokens))
        return via(tokens) + again + self.head(self.norm(self.embed(tokens))[:, 0])

    def normalized_head(self, features):
        """SwAV's habit inside the call: unit rows in place under ``no_grad``, then the rows
        compute with gradients."""
        with torch.no_grad():
            w = self.head.weight
            w.div_(w.norm(dim=1, keepdim=True))
        return self.forward_head(features)

    def rescale_(self, how: str = "tracked"):
        """In place on the gathered weights: a write autograd sees, one through ``.data``, a
        ``.data`` assignment."""
        with torch.no_grad():
            if how == "tracked":
                self.norm.weight.mul_(0.5)
            elif how == "data":
                self.norm.weight.data.mul_(1.5)
            else:
                self.norm.bias.data = self.norm.bias + 0.1


class Client(nn.Module):
    """Calls the trunk by name, as SSL clients do."""

    def __init__(self):
        super().__init__()
        self.trunk = Trunk()

    def forward(self, tokens, keep):
        features = self.trunk.forward_features(tokens)
        logits = self.trunk.normalized_head(features) + self.trunk.forward_head(features)
        kept = self.trunk.encode(tokens, keep)
        refined = self.trunk.refine(tokens, self.trunk)
        return logits.pow(2).mean() + kept.mean(1).pow(2).mean() + refined.tanh().mean()


def _batch(step, rank, world, per_rank=3):
    g = torch.Generator().manual_seed(100 + step)
    tokens = torch.randn(per_rank * world, TOKENS, IN, generator=g)
    keep = torch.rand(per_rank * world, TOKENS, generator=g).argsort(1)[:, :KEEP]
    rows = slice(rank * per_rank, (rank + 1) * per_rank)
    return tokens[rows], keep[rows]


def _wrapped(gather: bool = True, reshard: bool = True, precision: Precision = FULL_PRECISION):
    torch.manual_seed(0)
    return auto_wrap(
        Client(),
        by_class({TokenBlock: {}, Trunk: {}}),
        reshard_after_forward=reshard,
        precision=precision,
        gather_public_methods=gather,
    )


def _train(rank, world, how):
    """STEPS steps of SGD with momentum, the trunk written in place through its unit after each
    (and its head's rows normalised inside the forward); returns losses, the first step's gradients (name -> (this rank's part of the flat
    gradient, start, length)), the final weights and no-grad features afterwards."""
    if how == "ddp":
        torch.manual_seed(0)
        model = DDP(Client())
    else:
        model = _wrapped(reshard=how == "zero3")
    inner = model.module
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    losses, grads = [], {}
    for step in range(STEPS):
        loss = model(*_batch(step, rank, world))
        loss.backward()
        for name, param in model.named_parameters():
            if step == 0 and param.grad is not None:
                part = local_part(param)
                start, length = (part.start, part.length) if part else (0, param.numel())
                grads[name.removeprefix("module.")] = (param.grad.reshape(-1).clone(), start, length)
        optimizer.step()
        optimizer.zero_grad()
        inner.trunk.rescale_(("tracked", "data", "assign")[step])
        losses.append(loss.detach())
    tokens, _ = _batch(STEPS, rank, world)
    with torch.no_grad():
        features = inner.trunk.refine(tokens, inner.trunk)
    state = model.state_dict() if how != "ddp" else inner.state_dict()
    return torch.stack(losses), grads, state, features


def _grad_diff(ours, reference) -> float:
    """Worst relative difference of this rank's parts of the gradients to DDP's whole ones."""
    assert ours.keys() == reference.keys(), (sorted(ours), sorted(reference))
    worst = 0.0
    for name, (grad, start, length) in ours.items():
        if length:
            expect = reference[name][0][start : start + length]
            worst = max(worst, max_rel_diff(grad, expect))
    return worst


def _gathers_during(unit, fn):
    """``fn()``'s result and how many all-gathers of ``unit``'s own weights it started."""
    count = [0]
    for handle in unit.unit_state.handles:
        start = handle.start_unshard

        def counted(start=start):
            nbytes = start()
            count[0] += nbytes > 0
            return nbytes

        handle.start_unshard = counted
    try:
        return fn(), count[0]
    finally:
        for handle in unit.unit_state.handles:
            del handle.start_unshard


def _first_error(fn, kind) -> str:
    try:
        fn()
    except kind as error:
        return str(error)
    return "no error"


def _corners(rank, world):
    """Re-entrancy, write errors, nn.Module's methods, the option off."""
    out = {}
    model = _wrapped()
    trunk = model.module.trunk
    tokens, keep = _batch(0, rank, world)
    with torch.no_grad():
        _, out["reentrant_gathers"] = _gathers_during(trunk, lambda: trunk.refine(tokens, trunk))
    plain = Client()
    out["names"] = [n for n, _ in model.named_parameters()] == [n for n, _ in plain.named_parameters()]
    out["keys"] = sorted(model.state_dict()) == sorted(plain.state_dict())
    low = _wrapped(precision=Precision(compute_dtype=torch.bfloat16))
    out["write_mixed"] = _first_error(lambda: low.module.trunk.rescale_(), GatheredWriteError)
    kept = _wrapped()
    keep_on_shards(kept.module.trunk, "rescale_")
    kept.module.trunk.rescale_()  # on this rank's rows, nothing gathered
    off = _wrapped(gather=False)
    out["off"] = _first_error(lambda: off(tokens, keep), UnregisteredMethodError)
    cfg = load_config(["config=test/simclr_tiny", "config.MODEL.FSDP_CONFIG.GATHER_PUBLIC_METHODS=True"])
    out["config"] = [
        unit.gathers_public_methods for unit in shard_model(build_model(cfg.MODEL), cfg.MODEL).units()
    ]
    return out


def _all(rank, world):
    runs = {how: _train(rank, world, how) for how in ("ddp", "zero3", "zero2")}
    reference = runs.pop("ddp")
    compared = {
        how: {
            "losses": max_rel_diff(ours[0], reference[0]),
            "grads": _grad_diff(ours[1], reference[1]),
            "state": max_rel_diff(ours[2], reference[2]),
            "features": max_rel_diff(ours[3], reference[3]),
        }
        for how, ours in runs.items()
    }
    return {"compared": compared, "corners": _corners(rank, world)}


@pytest.fixture(scope="module")
def ranks():
    return run_on_ranks(_all, 2)


@pytest.mark.parametrize("how", ["zero3", "zero2"])
def test_public_methods_gather_and_train_as_ddp(ranks, how):
    for out in ranks:
        diffs = out["compared"][how]
        assert all(diff < 1e-5 for diff in diffs.values()), diffs


def test_a_call_back_into_the_gathered_unit_gathers_once(ranks):
    """``refine`` calls the unit's forward and gathered methods from inside one: one gather
    (its results equal DDP's above: freed early, it would compute with shards)."""
    assert [out["corners"]["reentrant_gathers"] for out in ranks] == [1, 1]


def test_a_write_into_low_precision_gathered_weights_is_one_line_naming_the_method(ranks):
    for out in ranks:
        message = out["corners"]["write_mixed"]
        assert "\n" not in message and message.startswith("Trunk.rescale_() wrote in place (mul_)"), message
        assert "weight trunk.norm.weight" in message and "mixed precision" in message
        assert 'keep_on_shards(module, "rescale_")' in message


def test_nn_modules_own_methods_keep_their_behaviour(ranks):
    for out in ranks:
        assert out["corners"]["names"] and out["corners"]["keys"]


def test_which_methods_gather():
    class Scaled(nn.Linear):  # torch's layer below: its methods stay its own
        def scaled(self, x):
            return 2 * self(x)

        def train(self, mode=True):
            return super().train(mode)

    trunk = Trunk()
    assert all(gathers_by_itself(trunk, n) for n in ("encode", "forward_features", "forward_head", "refine"))
    for name in ("width", "tokens_of", "state_dict", "named_parameters", "apply", "to", "_apply", "forward"):
        assert not gathers_by_itself(trunk, name), name
    assert gathers_by_itself(Scaled(2, 2), "scaled")
    for name in ("reset_parameters", "extra_repr", "train"):
        assert not gathers_by_itself(Scaled(2, 2), name), name
    keep_on_shards(trunk, "refine")
    assert not gathers_by_itself(trunk, "refine")
    with pytest.raises(ValueError, match="Trunk has no method 'refined'"):
        keep_on_shards(trunk, "refined")


def test_the_config_key_reaches_every_unit(ranks):
    assert load_config([]).MODEL.FSDP_CONFIG.GATHER_PUBLIC_METHODS is False
    for out in ranks:
        assert len(out["corners"]["config"]) > 1 and all(out["corners"]["config"])


def test_with_the_option_off_an_unregistered_method_stops_as_before(ranks):
    for out in ranks:
        message = out["corners"]["off"]
        assert message.startswith("Trunk.forward_features() computed with this rank's shard"), message
        assert 'register_forward_method(module, "forward_features")' in message
