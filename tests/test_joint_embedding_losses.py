"""MoCo v3, Barlow Twins, VICReg and LeJEPA losses against lightly 1.6.0 (a test-only oracle), in
one process and on real gloo ranks.

Oracles on the same tensors: ``NTXentLoss`` in MoCo's form (positive k_i, negatives from its
memory bank, which we fill with the other keys of the batch: exactly MoCo v3's in-batch InfoNCE,
without the 2 tau factor of the MoCo v3 code, so ours = 2 tau * lightly), ``BarlowTwinsLoss``,
``VICRegLoss`` and ``LeJEPALoss`` (its projections drawn from torch's global generator, seeded
here with our ``direction_seed(seed, step)``).

Distributed convention checked on 2 and 3 ranks against one process on the concatenated global
batch: the mean of the per-rank losses equals the single-process loss (for Barlow Twins, VICReg and
LeJEPA every rank's loss equals it), and each rank's gradient for its own rows is world_size times
the single-process gradient, so DDP's average yields the single-process parameter gradient (also
checked with DDP itself). Barlow Twins with ``authors_gradient_scale``: each rank's gradient
equals the authors' code written out (their all_reduce of C outside autograd), 1 / world_size of
the convention's.
"""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from lightly.loss import BarlowTwinsLoss, LeJEPALoss, NTXentLoss, VICRegLoss
from lightly.loss.lejepa_loss import SIGReg, lejepa_invariance_loss
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from vistrain.distributed.comm import all_gather_with_grad
from vistrain.distributed.testing import run_on_ranks
from vistrain.losses.barlow_twins import barlow_twins_loss
from vistrain.losses.lejepa import direction_seed, lejepa_loss, slice_directions
from vistrain.losses.moco import moco_v3_contrastive, symmetric_moco_v3_loss
from vistrain.losses.vicreg import vicreg_loss

TEMPERATURE = 0.3
OFF_DIAGONAL = 0.02  # lambda, larger than the paper's 5e-3 for D = 8192: small D here
SEED, STEP = 17, 4242
LEJEPA = dict(sigreg_weight=0.3, num_slices=48, knots=9, t_max=2.5)
TOLERANCES = {
    torch.float64: dict(rtol=1e-9, atol=1e-11),
    torch.float32: dict(rtol=1e-5, atol=1e-6),
}
# lightly keeps SIGReg's knots, weights and Gaussian characteristic function in float32 (ours follow
# the inputs' dtype): in float64 the two differ by up to ~2e-8 relative
LEJEPA_FP64 = dict(rtol=1e-7, atol=1e-9)
TIGHT = dict(rtol=1e-10, atol=1e-12)  # the same computation, reordered: ranks against one process


def oracle_tolerance(name, dtype):
    return LEJEPA_FP64 if (name, dtype) == ("lejepa", torch.float64) else TOLERANCES[dtype]


# the tensors each loss differentiates: its (N, D) inputs, or (V, N, D) with the batch on dim 1
INPUTS = {
    "moco": ("q1", "q2"),
    "barlow_twins": ("za", "zb"),
    "vicreg": ("za", "zb"),
    "lejepa": ("global_views", "local_views"),
}


def randn(*shape, seed, dtype=torch.float64):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=dtype)


def tensors(n, dim=6, seed=0, dtype=torch.float64):
    """Two views' embeddings of n images, correlated as augmented views are, plus teacher keys."""
    za = randn(n, dim, seed=seed + 1, dtype=dtype)
    return {
        "q1": randn(n, dim, seed=seed + 2, dtype=dtype),
        "q2": randn(n, dim, seed=seed + 3, dtype=dtype),
        "k1": randn(n, dim, seed=seed + 4, dtype=dtype),
        "k2": randn(n, dim, seed=seed + 5, dtype=dtype),
        "za": za,
        "zb": za + 0.7 * randn(n, dim, seed=seed + 6, dtype=dtype),
        "global_views": randn(2, n, dim, seed=seed + 7, dtype=dtype),
        "local_views": 1.5 * randn(3, n, dim, seed=seed + 8, dtype=dtype),
    }


def rows(t, start, stop):
    return t[:, start:stop] if t.dim() == 3 else t[start:stop]


def rank_rows(t, rank, world):
    n = t.shape[t.dim() - 2] // world
    return rows(t, rank * n, (rank + 1) * n)


def leaves(data):
    return {name: t.clone().requires_grad_(True) for name, t in data.items()}


# ---------------------------------------------------------------------------------- the two sides


def ours(t):
    return {
        "moco": symmetric_moco_v3_loss((t["q1"], t["q2"]), (t["k1"], t["k2"]), TEMPERATURE),
        "barlow_twins": barlow_twins_loss(t["za"], t["zb"], OFF_DIAGONAL),
        "vicreg": vicreg_loss(t["za"], t["zb"]),
        "lejepa": lejepa_loss(t["global_views"], t["local_views"], step=STEP, seed=SEED, **LEJEPA),
    }


def lightly_moco_ctr(q, k, temperature):
    """lightly's NTXentLoss in MoCo's form (query i against its positive k_i and the negatives in
    the memory bank), with the bank holding the other keys of the batch, averaged over queries."""
    n, dim = k.shape
    keys = F.normalize(k.detach(), dim=1)
    total = 0.0
    for i in range(n):
        loss = NTXentLoss(temperature, memory_bank_size=(n - 1, dim))
        loss.memory_bank.bank = torch.cat([keys[:i], keys[i + 1 :]])
        total = total + loss(q[i : i + 1], k[i : i + 1])
    return total / n


def lightly_lejepa(global_views, local_views, gather_distributed=False, **kw):
    kw = {**LEJEPA, **kw}
    loss = LeJEPALoss(
        lambda_param=kw["sigreg_weight"],
        gather_distributed=gather_distributed,
        sigreg_knots=kw["knots"],
        sigreg_t_max=kw["t_max"],
        sigreg_num_vectors=kw["num_slices"],
    )
    torch.manual_seed(direction_seed(SEED, STEP))  # lightly draws its projections from here
    return loss(local_proj=local_views, global_proj=global_views)


def lightly_losses(t):
    moco = lightly_moco_ctr(t["q1"], t["k2"], TEMPERATURE) + lightly_moco_ctr(t["q2"], t["k1"], TEMPERATURE)
    return {
        "moco": 2 * TEMPERATURE * moco,
        "barlow_twins": BarlowTwinsLoss(lambda_param=OFF_DIAGONAL)(t["za"], t["zb"]),
        "vicreg": VICRegLoss()(t["za"], t["zb"]),
        "lejepa": lightly_lejepa(t["global_views"], t["local_views"]),
    }


def values_and_grads(losses, inputs):
    return {
        name: (loss.detach(), torch.autograd.grad(loss, [inputs[k] for k in INPUTS[name]]))
        for name, loss in losses.items()
    }


# ------------------------------------------------------------------------------------- one process


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_losses_equal_lightly_values_and_gradients(dtype):
    mine, theirs = leaves(tensors(10, seed=100, dtype=dtype)), leaves(tensors(10, seed=100, dtype=dtype))
    got, want = values_and_grads(ours(mine), mine), values_and_grads(lightly_losses(theirs), theirs)
    for name, (value, grads) in got.items():
        assert value.dtype == dtype
        torch.testing.assert_close(value, want[name][0], **oracle_tolerance(name, dtype), msg=name)
        for g, w in zip(grads, want[name][1]):
            torch.testing.assert_close(g, w, **oracle_tolerance(name, dtype), msg=name)


def test_moco_keys_are_targets_and_ctr_is_the_lightly_form_times_two_tau():
    t = leaves(tensors(7, seed=110))
    for temperature in (0.1, 1.0):
        ctr = moco_v3_contrastive(t["q1"], t["k1"], temperature)
        torch.testing.assert_close(ctr, 2 * temperature * lightly_moco_ctr(t["q1"], t["k1"], temperature))
        assert torch.autograd.grad(ctr, t["k1"], allow_unused=True)[0] is None
    # the positives sit on the diagonal: a key batch equal to the queries gives the lowest loss
    q = t["q1"].detach()
    assert moco_v3_contrastive(q, q, 0.1) < moco_v3_contrastive(q, t["k1"].detach(), 0.1)


@pytest.mark.parametrize(
    "weights", [dict(invariance_weight=1.0, variance_weight=3.0, covariance_weight=0.5, eps=1e-3)]
)
def test_vicreg_and_barlow_twins_weights_match_lightly(weights):
    t = tensors(9, seed=120)
    kw = dict(lambda_param=1.0, mu_param=3.0, nu_param=0.5, eps=1e-3)
    torch.testing.assert_close(vicreg_loss(t["za"], t["zb"], **weights), VICRegLoss(**kw)(t["za"], t["zb"]))
    # embeddings of std ~3: the variance hinge is inactive at gamma 1, active at gamma 10
    wide = 3 * t["za"], 3 * t["zb"]
    assert (
        vicreg_loss(*wide, 0.0, 1.0, 0.0, gamma=1.0) == 0
        and vicreg_loss(*wide, 0.0, 1.0, 0.0, gamma=10.0) > 0
    )
    torch.testing.assert_close(barlow_twins_loss(t["za"], t["zb"]), BarlowTwinsLoss()(t["za"], t["zb"]))


@pytest.mark.parametrize("sigreg_weight", [0.0, 1.0])
def test_lejepa_terms_alone_match_lightly_and_local_views_are_optional(sigreg_weight):
    t = tensors(8, seed=130)
    got = lejepa_loss(
        t["global_views"],
        t["local_views"],
        step=STEP,
        seed=SEED,
        **{**LEJEPA, "sigreg_weight": sigreg_weight},
    )
    want = lightly_lejepa(t["global_views"], t["local_views"], sigreg_weight=sigreg_weight)
    torch.testing.assert_close(got, want, **LEJEPA_FP64)
    # without local views: lightly's two terms on the global views (its loss requires a local view)
    views = t["global_views"]
    torch.manual_seed(direction_seed(SEED, STEP))
    sigreg = SIGReg(knots=LEJEPA["knots"], t_max=LEJEPA["t_max"], num_vectors=LEJEPA["num_slices"])(views)
    invariance = lejepa_invariance_loss(all_proj=views, global_proj=views)
    want = sigreg_weight * sigreg + (1 - sigreg_weight) * invariance
    got = lejepa_loss(views, step=STEP, seed=SEED, **{**LEJEPA, "sigreg_weight": sigreg_weight})
    torch.testing.assert_close(got, want, **LEJEPA_FP64)


def test_lejepa_directions_are_reproducible_unit_gaussian_columns_per_seed_and_step():
    cpu = torch.device("cpu")
    a = slice_directions(5, 32, SEED, STEP, cpu, torch.float64)
    torch.testing.assert_close(a.norm(dim=0), torch.ones(32, dtype=torch.float64))
    assert torch.equal(a, slice_directions(5, 32, SEED, STEP, cpu, torch.float64))
    gaussian = torch.randn(
        5,
        32,
        dtype=torch.float64,
        generator=torch.Generator().manual_seed((STEP + SEED * 0x9E3779B9) % 2**32),
    )
    torch.testing.assert_close(a, gaussian / gaussian.norm(dim=0))
    # every (seed, step) its own directions (seed * 2**32 + step would not do: the CPU generator
    # keeps only the low 32 bits of a seed)
    for seed, step in ((SEED, STEP + 1), (SEED + 1, STEP), (SEED + 1, STEP - 1), (SEED + 2, STEP), (0, 0)):
        assert not torch.allclose(a, slice_directions(5, 32, seed, step, cpu, torch.float64))
    t = tensors(6, seed=140)
    loss = lambda step: lejepa_loss(t["global_views"], t["local_views"], step=step, seed=SEED, **LEJEPA)
    assert torch.equal(loss(STEP), loss(STEP)) and not torch.allclose(loss(STEP), loss(STEP + 1))


def test_losses_run_under_bf16_autocast_with_fp32_statistics():
    t = tensors(12, dim=8, seed=150, dtype=torch.float32)
    plain = ours(t)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        under_autocast = ours(t)  # fp32 inputs: the matmuls must not drop to bf16
        low = leaves({name: x.bfloat16() for name, x in t.items()})
        low_losses = ours(low)
    rounded = ours({name: x.bfloat16().float() for name, x in t.items()})
    for name in plain:
        assert under_autocast[name].dtype == torch.float32 and low_losses[name].dtype == torch.float32
        torch.testing.assert_close(under_autocast[name], plain[name], rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(low_losses[name], rounded[name], rtol=1e-6, atol=1e-6)
        grads = torch.autograd.grad(low_losses[name], [low[k] for k in INPUTS[name]])
        assert all(g.dtype == torch.bfloat16 and torch.isfinite(g).all() for g in grads), name


def test_errors_are_clear():
    one = randn(1, 4, seed=1)
    with pytest.raises(ValueError, match="at least 2 images in the global batch.*1 per rank on 1 ranks"):
        barlow_twins_loss(one, one)
    with pytest.raises(ValueError, match="vicreg_loss needs at least 2 images"):
        vicreg_loss(one, one)
    with pytest.raises(ValueError, match=r"one shape, got \[\(3, 4\), \(3, 5\)\]"):
        vicreg_loss(randn(3, 4, seed=1), randn(3, 5, seed=2))
    with pytest.raises(ValueError, match="one shape"):
        barlow_twins_loss(randn(3, 4, seed=1), randn(2, 4, seed=2))
    with pytest.raises(ValueError, match="off_diagonal_weight must be >= 0"):
        barlow_twins_loss(randn(3, 4, seed=1), randn(3, 4, seed=2), -1.0)
    with pytest.raises(ValueError, match="variance_weight must be >= 0"):
        vicreg_loss(randn(3, 4, seed=1), randn(3, 4, seed=2), variance_weight=-1.0)
    with pytest.raises(ValueError, match="temperature must be positive"):
        moco_v3_contrastive(randn(3, 4, seed=1), randn(3, 4, seed=2), 0.0)
    with pytest.raises(ValueError, match="one shape"):
        moco_v3_contrastive(randn(3, 4, seed=1), randn(4, 4, seed=2), 0.2)
    with pytest.raises(ValueError, match="two views"):
        symmetric_moco_v3_loss([one], [one, one], 0.2)
    views = randn(2, 3, 4, seed=3)
    with pytest.raises(ValueError, match="global_views"):
        lejepa_loss(views[0], step=0)
    with pytest.raises(ValueError, match="local_views"):
        lejepa_loss(views, randn(2, 3, 5, seed=4), step=0)
    with pytest.raises(ValueError, match="sigreg_weight must lie in"):
        lejepa_loss(views, step=0, sigreg_weight=1.5)
    with pytest.raises(ValueError, match="knots >= 2"):
        lejepa_loss(views, step=0, knots=1)
    # one image is a valid (if uninformative) sample for LeJEPA and MoCo: no error, finite
    assert torch.isfinite(lejepa_loss(views[:, :1], step=0)) and moco_v3_contrastive(one, one, 0.2) == 0


# -------------------------------------------------------------------------------------- gloo ranks


def _projector():
    torch.manual_seed(0)
    return nn.Linear(5, 6).double()


def projected_losses(model, x, keys):
    """The four losses on one forward of ``model`` over the views x (4, N, 5): views 0 and 1 are the
    two views (MoCo's queries against the fixed teacher ``keys``), 0-1 LeJEPA's global views and
    2-3 its local ones."""
    z = model(x)
    return ours({
        "q1": z[0], "q2": z[1], "k1": keys[0], "k2": keys[1], "za": z[0], "zb": z[1],
        "global_views": z[:2], "local_views": z[2:],
    })  # fmt: skip


def authors_barlow_twins(za, zb, lambd):
    """The Barlow Twins authors' main.py on this rank's rows: its BatchNorm1d(affine=False) made a
    SyncBatchNorm (the global batch's mean and biased variance; the statistics' gradient reaches
    every rank, as SyncBatchNorm's backward), c = bn(z1).T @ bn(z2) / B summed over the ranks by
    an all_reduce outside autograd."""
    world = dist.get_world_size()

    def bn(z):
        every = all_gather_with_grad(z)
        return (z - every.mean(0)) / torch.sqrt(every.var(0, unbiased=False) + 1e-5)

    c = bn(za).T @ bn(zb)
    c.div_(za.shape[0] * world)
    dist.all_reduce(c)
    off_diagonal = c - torch.diag(torch.diagonal(c))
    return torch.diagonal(c).add(-1).pow(2).sum() + lambd * off_diagonal.pow(2).sum()


def _distributed_worker(rank, world, data, x, keys):
    local = leaves({name: rank_rows(t, rank, world) for name, t in data.items()})
    out = {"ours": values_and_grads(ours(local), local)}
    # the authors' gradient scale: against their code written out
    authors = barlow_twins_loss(local["za"], local["zb"], OFF_DIAGONAL, authors_gradient_scale=True)
    reference = authors_barlow_twins(local["za"], local["zb"], OFF_DIAGONAL)
    out["authors"] = [
        values_and_grads({"barlow_twins": loss}, local)["barlow_twins"] for loss in (authors, reference)
    ]
    with torch.no_grad():  # lightly's own distributed forms, on the same rows
        za, zb = local["za"], local["zb"]
        out["lightly"] = {
            "barlow_twins": BarlowTwinsLoss(OFF_DIAGONAL, gather_distributed=True)(za, zb),
            "vicreg": VICRegLoss(gather_distributed=True)(za, zb),
            "lejepa": lightly_lejepa(local["global_views"], local["local_views"], gather_distributed=True),
        }
    # one image per rank: the batch statistics are over the world_size images of the global batch
    one = leaves({name: data[name][rank : rank + 1] for name in ("za", "zb")})
    out["one_per_rank"] = {
        "barlow_twins": values_and_grads({"barlow_twins": barlow_twins_loss(one["za"], one["zb"])}, one),
        "vicreg": values_and_grads({"vicreg": vicreg_loss(one["za"], one["zb"])}, one),
    }
    model = DDP(_projector())
    out["ddp"] = {}
    for name in INPUTS:
        model.zero_grad()
        projected_losses(model, rank_rows(x, rank, world), [rank_rows(k, rank, world) for k in keys])[
            name
        ].backward()
        out["ddp"][name] = [p.grad.clone() for p in model.parameters()]
    return out


@pytest.mark.parametrize("world", [2, 3])
def test_distributed_equals_lightly_on_the_global_batch(world):
    data = tensors(4 * world, seed=200 + world)
    x, keys = randn(4, 4 * world, 5, seed=210), [randn(4 * world, 6, seed=211 + i) for i in range(2)]
    results = run_on_ranks(_distributed_worker, world, data, x, keys)

    mine, theirs = leaves(data), leaves(data)
    single = values_and_grads(ours(mine), mine)  # one process on the global batch
    oracle = values_and_grads(lightly_losses(theirs), theirs)
    for name in INPUTS:
        for (value, grads), tol in (
            (single[name], TIGHT),
            (oracle[name], oracle_tolerance(name, torch.float64)),
        ):
            per_rank = [r["ours"][name][0] for r in results]
            torch.testing.assert_close(sum(per_rank) / world, value, **tol, msg=name)
            if name != "moco":  # global-batch statistics: every rank holds the global loss itself
                for v in per_rank:
                    torch.testing.assert_close(v, value, **tol, msg=name)
            for rank, r in enumerate(results):
                for got, g in zip(r["ours"][name][1], grads):
                    torch.testing.assert_close(got, world * rank_rows(g, rank, world), **tol, msg=name)
        # the same loss on one rank's rows alone is a different loss
        alone = ours({k: rank_rows(t, 0, world) for k, t in data.items()})[name]
        assert not torch.allclose(alone, results[0]["ours"][name][0], rtol=1e-3), name

    # Barlow Twins with the authors' scale: their code's value and gradients, i.e. each rank's rows
    # get the single-process gradient itself (not world times it): DDP's average is 1 / world of it
    value, grads = single["barlow_twins"]
    for rank, r in enumerate(results):
        (got_value, got_grads), (want_value, want_grads) = r["authors"]
        torch.testing.assert_close(got_value, want_value, **TIGHT)
        torch.testing.assert_close(got_value, value, **TIGHT)
        for got, want, g in zip(got_grads, want_grads, grads):
            torch.testing.assert_close(got, want, **TIGHT)
            torch.testing.assert_close(got, rank_rows(g, rank, world), **TIGHT)

    # lightly's distributed forms: VICReg and LeJEPA average to the global loss (their invariance
    # term is per rank); Barlow Twins standardises each rank's rows with that rank's own mean and
    # variance, so its gather_distributed loss is not the global-batch one
    for name in ("vicreg", "lejepa"):
        torch.testing.assert_close(sum(r["lightly"][name] for r in results) / world, oracle[name][0], **TIGHT)
    for r in results:
        assert not torch.allclose(r["lightly"]["barlow_twins"], oracle["barlow_twins"][0], rtol=1e-3)

    one = leaves({name: data[name][:world] for name in ("za", "zb")})
    single = {
        "barlow_twins": BarlowTwinsLoss()(one["za"], one["zb"]),
        "vicreg": VICRegLoss()(one["za"], one["zb"]),
    }
    for name, (value, grads) in values_and_grads(single, one).items():
        for rank, r in enumerate(results):
            got_value, got_grads = r["one_per_rank"][name][name]
            torch.testing.assert_close(got_value, value, **TIGHT, msg=name)
            for got, g in zip(got_grads, grads):
                torch.testing.assert_close(got, world * g[rank : rank + 1], **TIGHT, msg=name)

    model = _projector()
    for name in INPUTS:
        model.zero_grad()
        projected_losses(model, x, keys)[name].backward()
        for r in results:
            for got, p in zip(r["ddp"][name], model.parameters()):
                torch.testing.assert_close(got, p.grad, **TIGHT, msg=name)
