"""The engine in the corners a hand-written loop reaches, each against DDP (or the ordinary step)
on real gloo ranks: exceptions with gradient accumulation and with the step in backward,
``zero_grad()`` between micro-batches, a parameter without gradient inside a used unit, misuse of
the step in backward, float64 models, fp16 loss scaling over shards and hybrid groups.

One spawn per world size serves every check (``_corners``): each scenario returns its numbers or
the traceback that stopped it, and each test reads its own.
"""

import functools
import traceback
import warnings

import pytest
import torch
import torch.distributed as dist
from fsdp_models import Block, Net, local_batch, make_optimizer, max_rel_diff
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from vistrain import fsdp
from vistrain.distributed.testing import run_on_ranks
from vistrain.fsdp import (
    RootOptions,
    apply_optimizer_in_backward,
    auto_wrap,
    by_class,
    hybrid_groups,
)
from vistrain.methods import get_defaults
from vistrain.optim import LARS
from vistrain.runtime.sharding import unit_precision

TOL = 1e-5
STEPS = 4


# -- models --------------------------------------------------------------------------------------
class Explode(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        raise FloatingPointError("injected failure in backward")


class ExplodingNet(Net):
    """Raises in backward, when ``explode`` is set, at ``where``: "after_head" (only the ``twice``
    unit's gradient is in, its reduction still in flight) or "between_blocks" (the later units
    reduced; with the step in backward, stepped)."""

    explode = False
    where = "after_head"

    def forward(self, x):
        x = self.blocks[0](self.stem(x))
        if self.explode and self.where == "between_blocks":
            x = Explode.apply(x)
        x = self.head(self.blocks[1](x).mean((2, 3)))
        if self.explode and self.where == "after_head":
            x = Explode.apply(x)
        return self.twice(torch.relu(self.twice(x)))


class GatedBlock(Block):
    """A Block (one unit) with a parameter it never uses (``spare``) and one it uses when
    ``gate_on`` (``gate``), both flattened with the Block's convolutions."""

    gate_on = False

    def __init__(self, channels):
        super().__init__(channels)
        self.spare = nn.Parameter(torch.randn(channels, channels) / channels)
        self.gate = nn.Parameter(torch.linspace(0.5, 1.5, channels))

    def forward(self, x):
        x = super().forward(x)
        return x * self.gate[:, None, None] if self.gate_on else x


class GatedNet(Net):
    def __init__(self):
        super().__init__()
        self.blocks = nn.Sequential(GatedBlock(5), GatedBlock(5))


def _model(cls, seed=0):
    torch.manual_seed(seed)
    return cls()


def _sharded(cls, **kwargs):
    return auto_wrap(_model(cls), by_class([Block, nn.Linear]), **kwargs)


def _loss(model, step, rank, world, micro=0):
    x, y = local_batch(10 * step + micro, rank, world)
    return nn.functional.cross_entropy(model(x), y)


def _inner(model):
    return model.module


# -- items 3 and 4: accumulation with an exception, zero_grad between micro-batches --------------
def _accumulate(model, optimizer, rank, world, in_backward, fail_step=None, zero=None):
    """STEPS steps of two micro-batches (the first under no_sync). ``fail_step``: its synced
    backward raises and the loop goes on without zero_grad (DDP: the step is skipped).
    ``zero`` ("optimizer", "optimizer_keep", "model"): called between the micro-batches."""
    for step in range(STEPS):
        if fail_step == step and isinstance(model, DDP):
            continue
        for micro in range(2):
            _inner(model).explode = fail_step == step and micro == 1
            if micro == 1 and zero is not None:
                {
                    "optimizer": lambda: optimizer.zero_grad(),
                    "optimizer_keep": lambda: optimizer.zero_grad(set_to_none=False),
                    "model": lambda: model.zero_grad(),
                }[zero]()
            try:
                if micro == 0:
                    with model.no_sync():
                        (_loss(model, step, rank, world, micro) / 2).backward()
                else:
                    (_loss(model, step, rank, world, micro) / 2).backward()
            except FloatingPointError:
                break
        else:
            if not in_backward:
                optimizer.step()
                optimizer.zero_grad()
    _inner(model).explode = False
    return model


def _ddp_accumulated(rank, world, **kwargs):
    ref = DDP(_model(ExplodingNet))
    _accumulate(ref, make_optimizer("sgd", ref.parameters()), rank, world, False, **kwargs)
    return ref.module.state_dict()


def _engine_accumulated(rank, world, in_backward, **kwargs):
    model = _sharded(ExplodingNet)
    optimizer = make_optimizer("sgd", model.parameters())
    if in_backward:
        apply_optimizer_in_backward(model, optimizer)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _accumulate(model, optimizer, rank, world, in_backward, **kwargs)
    return model.state_dict(), [str(w.message) for w in caught]


def _recovery_drops_accumulated(rank, world):
    ref = _ddp_accumulated(rank, world, fail_step=1)
    out = {}
    for in_backward in (False, True):
        state, warned = _engine_accumulated(rank, world, in_backward, fail_step=1)
        out[in_backward] = (max_rel_diff(state, ref), warned)
    return out


def _zero_grad_drops_accumulated(rank, world):
    out = {}
    for zero in ("optimizer", "optimizer_keep", "model"):
        ref = _ddp_accumulated(rank, world, zero=zero)
        out[zero] = max_rel_diff(_engine_accumulated(rank, world, False, zero=zero)[0], ref)
    ref = _ddp_accumulated(rank, world, zero="model")
    out["model_in_backward"] = max_rel_diff(_engine_accumulated(rank, world, True, zero="model")[0], ref)
    return out


# -- item 2: a backward that fails after some units stepped ---------------------------------------
def _moved_units(model, before):
    """Names of the units whose shards on this rank differ from ``before``."""
    names = model.model_state.order.names
    return sorted(
        names[unit.unit_state.index]
        for unit in model.units()
        if any(not torch.equal(p, before[id(p)]) for h in unit.unit_state.handles for p in h.local_params)
    )


def _partial_step(rank, world):
    model = _sharded(ExplodingNet)
    apply_optimizer_in_backward(model, make_optimizer("sgd", model.parameters()))
    inner = _inner(model)
    inner.where = "between_blocks"
    errors = []
    for recover in ("forward", "reset"):
        _loss(model, 0, rank, world).backward()  # a whole step first
        before = {id(p): p.detach().clone() for p in model.parameters()}
        inner.explode = True
        with pytest.raises(FloatingPointError):
            _loss(model, 1, rank, world).backward()
        inner.explode = False
        moved = _moved_units(model, before)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            try:
                if recover == "forward":
                    _loss(model, 2, rank, world)
                else:
                    model.reset_iter_state()
            except fsdp.PartialStepError as error:
                errors.append((str(error), error.stepped_units, moved))
    _loss(model, 3, rank, world).backward()  # training goes on once the error was raised
    return errors


# -- item 5: a parameter without gradient inside a used unit --------------------------------------
def _gate_pattern(rank):
    """Steps at which ``blocks.1.gate`` is used on this rank: rank 0 alone at step 0 (so every
    rank gets the average), no rank at step 1 (skipped: AdamW's per-parameter step count and
    bias correction stay), every rank at step 2 (used again)."""
    return {0, 2} if rank == 0 else {2}


def _train_gated(model, optimizer, rank, world, optimizer_name, in_backward, accumulate):
    gated = _inner(model).blocks[1]
    gated = getattr(gated, "module", gated)
    pattern = _gate_pattern(rank)
    for step in range(STEPS):
        micro_batches = 2 if accumulate else 1
        for micro in range(micro_batches):
            # with accumulation the gate is used in the no_sync micro-batch only
            gated.gate_on = step in pattern and micro == 0
            last = micro + 1 == micro_batches
            with model.no_sync() if not last else _nothing():
                (_loss(model, step, rank, world, micro) / micro_batches).backward()
        if not in_backward:
            optimizer.step()
            optimizer.zero_grad()


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def _spare_state(model, optimizer):
    """The optimizer state of the ``blocks.*.spare`` parameters (never used: none, as under DDP)."""
    return [
        value
        for name, param in model.named_parameters()
        if name.endswith(".spare")
        for value in optimizer.state.get(param, {}).values()
    ]


def _unused_parameters(rank, world):
    out = {}
    cases = [("sgd", False, False), ("sgd", True, False), ("sgd", False, True), ("adamw", False, False)]
    cases.append(("adamw", True, False))
    # replication (shard groups of one rank: one all-reduce over the replicas per gradient)
    cases += [("sgd", False, True, 1), ("adamw", True, False, 1)]
    # by default, without find_unused_parameters (every unit is used on every rank here)
    cases += [
        ("sgd", False, False, "default"),
        ("adamw", False, True, "default"),
        ("adamw", True, False, "default"),
    ]
    for optimizer_name, in_backward, accumulate, *variant in cases:
        ref = DDP(_model(GatedNet), find_unused_parameters=True)
        ref_opt = make_optimizer(optimizer_name, ref.parameters())
        _train_gated(ref, ref_opt, rank, world, optimizer_name, False, accumulate)
        groups = hybrid_groups(variant[0]) if variant and variant[0] != "default" else None
        root = RootOptions(find_unused_parameters=variant != ["default"])
        model = _sharded(GatedNet, root=root, groups=groups)
        initial = model.state_dict()
        optimizer = make_optimizer(optimizer_name, model.parameters())
        if in_backward:
            apply_optimizer_in_backward(model, optimizer)
        _train_gated(model, optimizer, rank, world, optimizer_name, in_backward, accumulate)
        state = model.state_dict()
        spare = [k for k in state if k.endswith(".spare")]
        spare_state = _spare_state(model, optimizer)
        out[(optimizer_name, in_backward, accumulate, *variant)] = (
            max_rel_diff(state, ref.module.state_dict()),
            len(spare) == 2 and all(torch.equal(state[k], initial[k]) for k in spare),
            len(spare_state) == 0,
        )
    return out


# -- item 6: misuse of the step in backward -----------------------------------------------------
def _misuse(rank, world):
    errors = {}
    model = _sharded(Net)
    optimizer = make_optimizer("sgd", model.parameters())
    apply_optimizer_in_backward(model, optimizer)
    _loss(model, 0, rank, world).backward()
    cases = {
        "clip": lambda: model.clip_grad_norm_(1.0),
        "second": lambda: apply_optimizer_in_backward(model, make_optimizer("adamw", model.parameters())),
    }
    net = _model(Net)
    before_wrapping = make_optimizer("sgd", net.parameters())
    wrapped = auto_wrap(net, by_class([Block, nn.Linear]))
    cases["replaced"] = lambda: apply_optimizer_in_backward(wrapped, before_wrapping)
    for name, misuse in cases.items():
        try:
            misuse()
        except (RuntimeError, ValueError) as error:
            errors[name] = str(error)
    apply_optimizer_in_backward(model, optimizer)  # the same optimizer again is fine
    return errors


# -- item 7: float64 --------------------------------------------------------------------------
def _float64(rank, world):
    def run(model, optimizer, clip):
        for step in range(3):
            x, y = local_batch(step, rank, world)
            nn.functional.cross_entropy(model(x.double()), y).backward()
            if clip:
                if isinstance(model, DDP):
                    torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
                else:
                    model.clip_grad_norm_(0.05)
            optimizer.step()
            optimizer.zero_grad()

    lars = functools.partial(LARS, lr=0.5, momentum=0.9, weight_decay=1e-4, eta=0.02)
    precision = unit_precision(get_defaults().MODEL.FSDP_CONFIG)
    out = {}
    for clip in (False, True):
        ref = DDP(_model(Net).double())
        run(ref, lars(ref.parameters()), clip)
        model = auto_wrap(_model(Net).double(), by_class([Block, nn.Linear]), precision=precision)
        run(model, lars(model.parameters()), clip)
        out[clip] = max_rel_diff(model.state_dict(), ref.module.state_dict())
    return out


SCENARIOS = {
    "recovery": _recovery_drops_accumulated,
    "zero_grad": _zero_grad_drops_accumulated,
    "partial_step": _partial_step,
    "unused": _unused_parameters,
    "misuse": _misuse,
    "float64": _float64,
}


def _corners_worker(rank, world):
    out = {}
    for name, scenario in SCENARIOS.items():
        try:
            out[name] = scenario(rank, world)
        except Exception:
            out[name] = "failed:\n" + traceback.format_exc()
        dist.barrier()
    return out


@pytest.fixture(scope="module")
def corners():
    return run_on_ranks(_corners_worker, 2)


def _results(corners, name):
    for per_rank in corners:
        result = per_rank[name]
        assert not (isinstance(result, str) and result.startswith("failed:")), result
    return [per_rank[name] for per_rank in corners]


def test_recovery_drops_the_no_sync_gradients_of_the_failed_step(corners):
    """Two micro-batches per step, the synced backward of step 1 raises, the loop goes on without
    zero_grad: as DDP skipping step 1 (ordinary step and step in backward)."""
    for result in _results(corners, "recovery"):
        for in_backward, (diff, warned) in result.items():
            assert diff < TOL, (in_backward, diff)
            assert len(warned) == 1 and "previous backward did not finish" in warned[0], warned


def test_zero_grad_drops_gradients_accumulated_under_no_sync(corners):
    """optimizer.zero_grad() (to None or to zeros) or model.zero_grad() between the micro-batches
    drops the first one's gradient, as DDP's ``.grad``."""
    for result in _results(corners, "zero_grad"):
        for zero, diff in result.items():
            assert diff < TOL, (zero, diff)


def test_a_backward_failing_after_units_stepped_in_backward_is_an_error(corners):
    for errors in _results(corners, "partial_step"):
        assert len(errors) == 2, errors  # by the next forward, and by reset_iter_state()
        for message, units, moved in errors:
            assert units == ["head", "twice"], units
            assert moved == units, (moved, units)  # exactly the named units moved
            assert "the model is partly updated: restore" in message and "\n" not in message, message


def test_a_parameter_without_gradient_does_not_move(corners):
    """``blocks.*.spare`` never gets a gradient, ``blocks.1.gate`` on some steps and ranks: by
    default and with find_unused_parameters the engine equals DDP's (with the flag), SGD and
    AdamW, in both step modes, with and without accumulation; the unused parameters keep
    ``.grad = None``: no step, no optimizer state."""
    results = _results(corners, "unused")
    for result in results:
        for case, (diff, spare_unmoved, no_state) in result.items():
            assert diff < TOL, (case, diff)
            assert spare_unmoved and no_state, case


def test_misuse_of_the_step_in_backward_is_one_line(corners):
    for errors in _results(corners, "misuse"):
        assert set(errors) == {"clip", "second", "replaced"}, errors
        assert "clip_grad_norm_() cannot clip with the step in backward" in errors["clip"]
        assert "another optimizer is already bound to this model" in errors["second"]
        assert "replaced by shards (it would train nothing)" in errors["replaced"]
        assert all("\n" not in e for e in errors.values()), errors


def test_float64_models_reduce_and_take_lars_norms_in_float64(corners):
    for result in _results(corners, "float64"):
        for clip, diff in result.items():
            assert diff < 1e-12, (clip, diff)


# -- item 1: fp16 loss scaling over shards, full and hybrid --------------------------------------
class InfAt(torch.autograd.Function):
    """Identity; in backward, ``grad[index] = inf`` when ``fire``."""

    @staticmethod
    def forward(ctx, x, index, fire):
        ctx.index, ctx.fire = index, fire
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        if ctx.fire:
            grad = grad.clone()
            grad.view(-1)[ctx.index] = float("inf")
        return grad, None, None


class InfLinear(nn.Linear):
    """A Linear whose weight gets an inf gradient at element 40 when ``fire``."""

    fire = False

    def forward(self, x):
        return nn.functional.linear(x, InfAt.apply(self.weight, 40, self.fire), self.bias)


class InfNet(Net):
    """``twice`` (a unit of 7 x 7 + 7 = 56 elements) is an InfLinear: element 40 of its flat
    parameter lies in one rank's shard only (the third of 4 ranks; the second of a group of 2)."""

    def __init__(self):
        super().__init__()
        self.twice = InfLinear(7, 7)


def _fp16_steps(model, scaler, optimizer, rank, world):
    """Five steps under autocast fp16; rank 0's gradient overflows at step 2 only."""
    losses, scales = [], []
    twice = _inner(model).twice
    for step in range(5):
        getattr(twice, "module", twice).fire = step == 2 and rank == 0
        x, y = local_batch(step, rank, world)
        with torch.autocast("cpu", dtype=torch.float16):
            loss = nn.functional.cross_entropy(model(x), y)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad()
        losses.append(loss.item())
        scales.append(scaler.get_scale())
    return losses, scales


def _fp16_worker(rank, world):
    ref = DDP(_model(InfNet))
    ref_opt = make_optimizer("sgd", ref.parameters())
    ref_out = _fp16_steps(ref, torch.amp.GradScaler("cpu"), ref_opt, rank, world)
    out = {}
    for name, groups in (("full", None), ("hybrid", hybrid_groups(2))):
        model = _sharded(InfNet, groups=groups)
        optimizer = make_optimizer("sgd", model.parameters())
        losses, scales = _fp16_steps(model, model.grad_scaler(), optimizer, rank, world)
        out[name] = (
            max_rel_diff(losses, ref_out[0]),
            scales,
            max_rel_diff(model.state_dict(), ref.module.state_dict()),
        )
    return ref_out[1], out


def test_fp16_loss_scaling_skips_an_overflow_in_one_shard_on_every_rank():
    """An inf in one rank's gradient lands in the last rank's shard only; every rank skips that
    step and halves the scale, as DDP with torch's GradScaler("cpu"); over the world's shard
    group (4 ranks) and over shard groups of 2 with replicas (the flags need only the shard
    group: replicas hold the same, world-averaged, shard gradients)."""
    for ref_scales, out in run_on_ranks(_fp16_worker, 4):
        assert ref_scales == [65536.0, 65536.0, 32768.0, 32768.0, 32768.0], ref_scales
        for name, (loss_diff, scales, state_diff) in out.items():
            assert scales == ref_scales, (name, scales)
            # fp16 compute turns the engine's divide-before-sum (fp32 rounding) into 1e-5 apart
            assert loss_diff < 1e-6 and state_diff < 1e-4, (name, loss_diff, state_diff)
