"""SimSiam, NNCLR and the supervised method: the losses against lightly 1.6.0 (a test-only oracle)
on the same tensors, in one process and on 2 gloo ranks against one process on the global batch;
their heads, criteria and one-line errors; the optimizer's fixed lr (SimSiam's predictor). Their
demos train sharded = DDP and resume from 2 ranks on 3 in tests/test_joint_embedding_methods.py.

Oracles: SimSiam ``NegativeCosineSimilarity`` on (p1, z2) and (p2, z1), the targets detached, as
lightly's SimSiam example; NNCLR ``NNMemoryBankModule`` (z0 looked up, then z1 looked up and
enqueued) and ``NTXentLoss`` on (NN(z0), p1) and (NN(z1), p0), as lightly's NNCLR example, its bank
starting from ours. Cross-entropy: ``F.cross_entropy`` on the labels repeated per crop.
"""

import math
import re

import pytest
import torch
import torch.nn.functional as F
from lightly.loss import NegativeCosineSimilarity, NTXentLoss
from lightly.models.modules import NNMemoryBankModule
from torch import nn

from vistrain.config import ConfigError, DataError
from vistrain.distributed.testing import run_on_ranks
from vistrain.losses.nnclr import SupportSet, nnclr_loss
from vistrain.losses.simclr import SimCLRLoss
from vistrain.losses.simsiam import symmetric_simsiam_loss
from vistrain.methods import build_method, build_model, check_config, load_config
from vistrain.optim import build_lr_schedule, build_optimizer, set_lr

TEMPERATURE, QUEUE, STEPS = 0.3, 12, 3  # the queue: 2 single-process batches of 6, wraps at step 3
TOLERANCES = {torch.float64: dict(rtol=1e-9, atol=1e-11), torch.float32: dict(rtol=1e-6, atol=1e-6)}
TIGHT = dict(rtol=1e-10, atol=1e-12)  # the same computation, reordered: ranks against one process


def randn(*shape, seed, dtype=torch.float64):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=dtype)


def step_tensors(n, step, dim=5, dtype=torch.float64):
    """One step's two views: projections z0, z1 and predictions p0, p1 (N, D), logits (2N, 7) and
    labels (N,)."""
    seed = 1000 * step
    z0 = randn(n, dim, seed=seed + 1, dtype=dtype)
    return {
        "z0": z0,
        "z1": z0 + 0.5 * randn(n, dim, seed=seed + 2, dtype=dtype),
        "p0": randn(n, dim, seed=seed + 3, dtype=dtype),
        "p1": randn(n, dim, seed=seed + 4, dtype=dtype),
        "logits": randn(2 * n, 7, seed=seed + 5, dtype=dtype),
        "labels": torch.randint(0, 7, (n,), generator=torch.Generator().manual_seed(seed + 6)),
    }


def leaves(data):
    return {k: t.clone().requires_grad_(True) if t.is_floating_point() else t for k, t in data.items()}


def rank_rows(data, rank, world):
    """This rank's rows of each tensor (the logits: crop by crop)."""
    out = {}
    for name, t in data.items():
        if name == "logits":
            out[name] = torch.cat([c.chunk(world)[rank] for c in t.chunk(2)])
        else:
            out[name] = t.chunk(world)[rank]
    return out


GRADS = {"simsiam": ("p0", "p1", "z0", "z1"), "nnclr": ("p0", "p1"), "supervised": ("logits",)}


def ours(t, support):
    """The three losses of one step (NNCLR's pushes z1 into ``support``)."""
    contrast = SimCLRLoss(TEMPERATURE)
    return {
        "simsiam": symmetric_simsiam_loss((t["p0"], t["p1"]), (t["z0"], t["z1"])),
        "nnclr": nnclr_loss((t["z0"], t["z1"]), (t["p0"], t["p1"]), support, contrast),
        "supervised": F.cross_entropy(t["logits"], t["labels"].repeat(2)),
    }


def grads_of(losses, t):
    out = {}
    for name, loss in losses.items():
        grads = torch.autograd.grad(loss, [t[k] for k in GRADS[name]], allow_unused=True)
        out[name] = (
            loss.detach(),
            [torch.zeros_like(t[k]) if g is None else g for k, g in zip(GRADS[name], grads)],
        )
    return out


def support_set(dtype=torch.float64):
    """A support set of unit rows in ``dtype`` (its fp32 rows normalised again)."""
    support = SupportSet(QUEUE, 5, seed=7).to(dtype)
    support.queue.copy_(F.normalize(support.queue, dim=1))
    return support


# ------------------------------------------------------------------------------- one process


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_losses_equal_lightly_over_steps(dtype):
    """Three steps (the queue wraps around at the third): the values, the gradients, and the
    support set against lightly's bank (which keeps the raw projections: compared normalised)."""
    support = support_set(dtype)
    bank = NNMemoryBankModule(size=(QUEUE, 5))
    bank.bank = support.queue.clone()
    bank.bank_ptr.zero_()
    negative_cosine, nt_xent = NegativeCosineSimilarity(), NTXentLoss(TEMPERATURE)
    for step in range(STEPS):
        data = step_tensors(6, step, dtype=dtype)
        mine, theirs = leaves(data), leaves(data)
        got = grads_of(ours(mine, support), mine)
        nn0 = bank(theirs["z0"].detach(), update=False)
        nn1 = bank(theirs["z1"].detach(), update=True)
        want = grads_of(
            {
                "simsiam": 0.5 * negative_cosine(theirs["p0"], theirs["z1"].detach())
                + 0.5 * negative_cosine(theirs["p1"], theirs["z0"].detach()),
                "nnclr": 0.5 * (nt_xent(nn0, theirs["p1"]) + nt_xent(nn1, theirs["p0"])),
                "supervised": F.cross_entropy(theirs["logits"], theirs["labels"].repeat(2)),
            },
            theirs,
        )
        for name, (value, grads) in got.items():
            assert value.dtype == dtype, name
            torch.testing.assert_close(value, want[name][0], **TOLERANCES[dtype], msg=f"{name} step {step}")
            for g, w in zip(grads, want[name][1]):
                torch.testing.assert_close(g, w, **TOLERANCES[dtype], msg=f"{name} step {step}")
        torch.testing.assert_close(support.queue, F.normalize(bank.bank, dim=1), **TOLERANCES[dtype])
    assert int(support.position) == (STEPS * 6) % QUEUE


def test_the_support_set_is_a_ring_of_unit_rows_and_its_neighbours_are_by_cosine():
    support = SupportSet(5, 3, seed=1)
    torch.testing.assert_close(support.queue.norm(dim=1), torch.ones(5))
    assert torch.equal(support.queue, SupportSet(5, 3, seed=1).queue)  # the seed, not torch's state
    assert not torch.equal(support.queue, SupportSet(5, 3, seed=2).queue)
    rows = torch.tensor([[3.0, 0, 0], [0, -2, 0], [0, 0, 5]])
    support.push(rows)
    support.push(rows[:1] * 2)
    assert int(support.position) == 4
    support.push(rows[1:])  # wraps: rows 4 and 0
    expected = [[0, 0, 1], [0, -1, 0], [0, 0, 1], [1, 0, 0], [0, -1, 0]]
    torch.testing.assert_close(support.queue, torch.tensor(expected, dtype=torch.float32))
    near = support.nearest(torch.tensor([[0.1, -9.0, 0.2], [9.0, 0.1, 0.0]]))
    torch.testing.assert_close(near, torch.tensor([[0, -1.0, 0], [1.0, 0, 0]]))
    support.push(torch.randn(7, 3))  # a batch longer than the queue: its last 5 rows
    assert int(support.position) == 0


def test_simsiam_targets_are_stopped_and_its_minimum_is_minus_one():
    t = leaves(step_tensors(4, 0))
    loss = symmetric_simsiam_loss((t["p0"], t["p1"]), (t["z0"], t["z1"]))
    assert torch.autograd.grad(loss, [t["z0"], t["z1"]], allow_unused=True) == (None, None)
    z = t["z0"].detach()
    torch.testing.assert_close(
        symmetric_simsiam_loss((3 * z, z), (z, 2 * z)), torch.tensor(-1.0, dtype=z.dtype)
    )
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert symmetric_simsiam_loss((z.float(), z.float()), (z.float(), z.float())).dtype == torch.float32


# ------------------------------------------------------------------------------- gloo ranks


def _rank_steps(rank, world):
    support = support_set()
    out = []
    for step in range(STEPS):
        local = leaves(rank_rows(step_tensors(4 * world, step), rank, world))
        out.append({"losses": grads_of(ours(local, support), local), "queue": support.queue.clone()})
    return out


def test_two_ranks_equal_one_process_on_the_global_batch():
    """Mean of the per-rank losses = the single-process loss, each rank's gradient world_size x the
    single-process one for its rows (DDP's average: the single-process gradient), and every rank's
    support set the single process's after each step."""
    world = 2
    results = run_on_ranks(_rank_steps, world)
    support = support_set()
    for step in range(STEPS):
        data = leaves(step_tensors(4 * world, step))
        single = grads_of(ours(data, support), data)
        for name, (value, grads) in single.items():
            per_rank = [r[step]["losses"][name] for r in results]
            torch.testing.assert_close(sum(v for v, _ in per_rank) / world, value, **TIGHT, msg=name)
            for rank, (_, rank_grads) in enumerate(per_rank):
                rows = rank_rows(dict(zip(GRADS[name], grads)), rank, world)
                for k, got in zip(GRADS[name], rank_grads):
                    torch.testing.assert_close(got, world * rows[k], **TIGHT, msg=f"{name} {k}")
        for r in results:
            torch.testing.assert_close(r[step]["queue"], support.queue, **TIGHT)


# ------------------------------------------------------------------------------- the methods


def _tiny(name, *overrides):
    return load_config([f"config=test/{name}_tiny", *overrides])


def test_the_heads_are_the_authors():
    simsiam = build_model(_tiny("simsiam").MODEL).head
    norms = [(m.num_features, m.affine) for m in simsiam.modules() if isinstance(m, nn.BatchNorm1d)]
    # projector [16, 32, 32, 16]: BN in every layer, the output's without affine; predictor [16, 8, 16]
    assert norms == [(32, True), (32, True), (16, False), (8, True)]
    assert isinstance(simsiam.predictor.layers[-1], nn.Linear)
    nnclr = build_model(_tiny("nnclr").MODEL).head
    norms = [(m.num_features, m.affine) for m in nnclr.modules() if isinstance(m, nn.BatchNorm1d)]
    assert norms == [(32, True), (16, True), (32, True)]  # lightly's NNCLRProjectionHead: affine output BN
    supervised = build_model(_tiny("supervised").MODEL).head
    assert [type(m) for m in supervised.layers] == [nn.Linear] and supervised.layers[0].out_features == 10


def test_each_criterion_calls_its_loss_on_its_crops():
    torch.manual_seed(0)
    n, d = 4, 16
    z, p = torch.randn(2 * n, d), torch.randn(2 * n, d)
    simsiam = build_method(_tiny("simsiam"))
    got = simsiam((z, p), 2)
    assert got == symmetric_simsiam_loss(p.chunk(2), z.chunk(2)) and simsiam.teacher_momentum is None
    nnclr = build_method(_tiny("nnclr"))
    support = SupportSet(12, d, seed=0)
    support.load_state_dict(nnclr.support.state_dict())
    assert nnclr((z, p), 2) == nnclr_loss(z.chunk(2), p.chunk(2), support, SimCLRLoss(0.2))
    torch.testing.assert_close(nnclr.support.queue, support.queue, rtol=0, atol=0)
    assert int(nnclr.support.position) == n
    supervised = build_method(_tiny("supervised"))
    logits, labels = torch.randn(3 * n, 10), torch.tensor([3, 0, 9, 3])
    supervised.set_batch({"label": labels})
    assert supervised(logits, 3) == F.cross_entropy(logits, labels.repeat(3))


@pytest.mark.parametrize(
    "name, output, crops, message",
    [
        ("simsiam", (torch.zeros(12, 4), torch.zeros(12, 4)), 3, "exactly 2 crops per image, got 3"),
        ("simsiam", torch.zeros(12, 4), 2, "from a simsiam head"),
        ("nnclr", (torch.zeros(12, 16), torch.zeros(12, 16)), 1, "exactly 2 crops per image, got 1"),
        ("supervised", torch.zeros(12, 10), 2, "the labels of the batch set_batch"),
    ],
)  # fmt: skip
def test_a_criterion_refuses_what_its_head_does_not_make(name, output, crops, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        build_method(_tiny(name))(output, crops)


@pytest.mark.parametrize(
    "labels, line",
    [
        ([1, -1, 2, -1], "LOSS.NAME=supervised_loss trains on labels, but 4 of the batch's 8 crops have none "
         "(label -1): give DATA.TRAIN labelled images"),
        ([1, 10, 2, 3], "DATA.TRAIN has label 10, but the supervised head has MODEL.HEAD.DIMS[-1]=10 classes"),
    ],
)  # fmt: skip
def test_the_supervised_method_refuses_images_without_a_class_in_one_line(labels, line):
    supervised = build_method(_tiny("supervised"))
    supervised.set_batch({"label": torch.tensor(labels)})
    with pytest.raises(DataError, match=re.escape(line)) as error:
        supervised(torch.zeros(8, 10), 2)
    assert "\n" not in str(error.value)


@pytest.mark.parametrize(
    "name, overrides, line",
    [
        ("simsiam", ["config.MODEL.HEAD.PREDICTOR_DIMS=[16,8,12]"],
         "MODEL.HEAD.PREDICTOR_DIMS must start and end with MODEL.HEAD.DIMS[-1] (16)"),
        ("nnclr", ["config.MODEL.HEAD.PREDICTOR_DIMS=[8,16]"],
         "MODEL.HEAD.PREDICTOR_DIMS must start and end with MODEL.HEAD.DIMS[-1] (16)"),
        ("simsiam", ["config.DATA.TRAIN.TRANSFORMS.NUM_CROPS=[2,2]"],
         "LOSS.NAME=simsiam_loss takes exactly 2 crops per image"),
        ("nnclr", ["config.MODEL.HEAD.NAME=simsiam"],
         "LOSS.NAME=nnclr_loss reads a nnclr head: set MODEL.HEAD.NAME=nnclr (now simsiam)"),
    ],
)  # fmt: skip
def test_a_config_the_method_cannot_train_is_one_line(name, overrides, line):
    with pytest.raises(ConfigError, match=re.escape(line)):
        cfg = _tiny(name, *overrides)
        build_method(cfg)
        build_model(cfg.MODEL)


@pytest.mark.parametrize(
    "override, line",
    [
        ("config.LOSS.nnclr_loss.temperature=0", "LOSS.nnclr_loss.temperature must be > 0; got 0.0"),
        ("config.LOSS.nnclr_loss.queue_length=0", "LOSS.nnclr_loss.queue_length must be >= 1"),
        ("config.LOSS.supervised_loss.label_smoothing=1", "LOSS.supervised_loss.label_smoothing must be < 1"),
    ],
)  # fmt: skip
def test_a_bad_value_of_a_methods_key_is_one_line(override, line):
    with pytest.raises(ConfigError, match=re.escape(line)):
        check_config(load_config(["config=test/simclr_tiny", override]), lambda: None)


def test_fixed_lr_params_train_at_the_peak_from_the_first_step_to_the_last():
    cfg = _tiny("simsiam")  # lr 0.05, a warm-up of half an epoch (2 steps), then a cosine to 0
    optimizer = build_optimizer(cfg.OPTIMIZER, build_model(cfg.MODEL))
    fixed = {g["name"]: g.get("fixed_lr", False) for g in optimizer.param_groups}
    assert fixed == {"decay": False, "no_decay": False, "decay_fixed_lr": True, "no_decay_fixed_lr": True}
    predictor = {id(p) for p in build_model(cfg.MODEL).head.predictor.parameters()}
    assert sum(len(g["params"]) for g in optimizer.param_groups if g.get("fixed_lr")) == len(predictor)
    schedule = build_lr_schedule(cfg.OPTIMIZER, 4)
    for iteration, lr in ((0, 0.025), (1, 0.05), (7, 0.05 * (1 + math.cos(5 / 6 * math.pi)) / 2)):
        set_lr(optimizer, schedule(iteration), schedule.peak)
        lrs = {g["name"]: g["lr"] for g in optimizer.param_groups}
        assert lrs["decay"] == pytest.approx(lr) and lrs["decay_fixed_lr"] == pytest.approx(0.05)
    with pytest.raises(ConfigError, match=re.escape("is for pretraining (JOB train)")):
        set_lr(optimizer, 0.1)
    wrong = _tiny("simsiam", "config.OPTIMIZER.fixed_lr_params=[head.predicter]")
    with pytest.raises(ConfigError, match=re.escape("'head.predicter' names no trainable parameter")):
        build_optimizer(wrong.OPTIMIZER, build_model(wrong.MODEL))
