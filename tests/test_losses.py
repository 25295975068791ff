"""SimCLR / SwAV losses, distributed Sinkhorn-Knopp and the trainer-facing criteria.

Multi-rank tests run real gloo processes and compare with one process computing the loss over
the concatenated global batch. Convention checked: mean of per-rank losses == single-process
loss, and each rank's input gradient == world_size * single-process gradient (DDP's averaging
then yields the single-process parameter gradient, also checked directly with DDP).
"""

import contextlib
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import vistrain.fsdp
from vistrain.distributed.testing import run_on_ranks
from vistrain.losses import SimCLRLoss, SwAVLoss, sinkhorn_knopp
from vistrain.methods import build_loss, get_defaults
from vistrain.methods.swav import SwAVHead

TEMPERATURE = 0.1


def randn(*shape, seed=0, dtype=torch.float64):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=dtype)


def rank_slice(t, rank, world):
    n = t.shape[0] // world
    return t[rank * n : (rank + 1) * n]


# -------------------------------------------------------------------------------------- references


def naive_nt_xent(z1, z2, temperature):
    """Loop-over-anchors NT-Xent, straight from the SimCLR paper (all 2N views are candidates)."""
    z = F.normalize(torch.cat([z1, z2]), dim=1)
    n2 = z.shape[0]
    total = 0.0
    for i in range(n2):
        positive = (i + n2 // 2) % n2
        sims = torch.stack([z[i] @ z[k] / temperature for k in range(n2) if k != i])
        total = total - (z[i] @ z[positive] / temperature - torch.logsumexp(sims, 0))
    return total / n2


def naive_multicrop_nt_xent(views, temperature, num_global_crops=0, prior=0.0, beta=0.0):
    """Loop over anchors and their positives: each of an image's other views scored against the
    views of the other images only (VISSL's multi-crop SimCLR form); with ``num_global_crops`` G
    > 0 a pair of two views from G on is skipped (DINO's local-to-global pairs). ``beta``: the
    negatives weighted by exp(beta s) / mean exp(beta s) (Robinson et al.); ``prior``: their sum
    debiased to max((S - prior M e^{s_p}) / (1 - prior), M e^{-1/t}) (Chuang et al.)."""
    num_views, n = len(views), views[0].shape[0]
    z = [F.normalize(v, dim=1) for v in views]
    total, count = 0.0, 0
    for c in range(num_views):
        for i in range(n):
            negatives = torch.stack(
                [z[c][i] @ z[d][k] / temperature for d in range(num_views) for k in range(n) if k != i]
            )
            weights = torch.exp(beta * negatives) / torch.exp(beta * negatives).mean()
            weighted_sum = (weights * torch.exp(negatives)).sum()
            for d in range(num_views):
                if d != c and (num_global_crops == 0 or min(c, d) < num_global_crops):
                    positive = z[c][i] @ z[d][i] / temperature
                    m = len(negatives)
                    debiased = (weighted_sum - prior * m * torch.exp(positive)) / (1 - prior)
                    negative_sum = torch.clamp(debiased, min=m * math.exp(-1 / temperature))
                    total = total - (positive - torch.log(torch.exp(positive) + negative_sum))
                    count += 1
    return total / count


def naive_sinkhorn(scores, epsilon, iterations):
    """SwAV's Algorithm (float64, one process, no stabilisation)."""
    q = torch.exp(scores.double() / epsilon).t()
    q /= q.sum()
    k, b = q.shape
    for _ in range(iterations):
        q /= q.sum(dim=1, keepdim=True) * k
        q /= q.sum(dim=0, keepdim=True) * b
    return (q * b).t()


def naive_swav(crop_scores, temperature, epsilon, iterations, crops_for_assign, extra=None):
    total = 0.0
    n = crop_scores[0].shape[0]
    for i, c in enumerate(crops_for_assign):
        pool = crop_scores[c].detach()
        if extra is not None:
            pool = torch.cat([extra[i], pool])
        q = naive_sinkhorn(pool, epsilon, iterations)[-n:]
        sub = 0.0
        for t in range(len(crop_scores)):
            if t != c:
                sub = sub - (q * torch.log_softmax(crop_scores[t] / temperature, 1)).sum(1).mean()
        total = total + sub / (len(crop_scores) - 1)
    return total / len(crops_for_assign)


# ------------------------------------------------------------------------------------------ SimCLR


def test_simclr_matches_paper_formula():
    z1, z2 = randn(6, 5, seed=1), randn(6, 5, seed=2)
    torch.testing.assert_close(SimCLRLoss(TEMPERATURE)(z1, z2), naive_nt_xent(z1, z2, TEMPERATURE))
    z1.requires_grad_(True)
    loss = SimCLRLoss(0.5)(z1.float(), z2.float())
    assert loss.dtype == torch.float32
    loss.backward()
    assert torch.isfinite(z1.grad).all()


def test_simclr_low_precision_inputs_computed_in_fp32():
    z1, z2 = randn(8, 16, seed=1, dtype=torch.float32), randn(8, 16, seed=2, dtype=torch.float32)
    ref = SimCLRLoss(TEMPERATURE)(z1.bfloat16().float(), z2.bfloat16().float())
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = SimCLRLoss(TEMPERATURE)(z1.bfloat16(), z2.bfloat16())
    assert loss.dtype == torch.float32
    torch.testing.assert_close(loss, ref)


def test_simclr_multicrop_matches_the_loop_and_two_views_match_the_paper():
    views = [randn(5, 4, seed=20 + c) for c in range(4)]
    torch.testing.assert_close(SimCLRLoss(TEMPERATURE)(*views), naive_multicrop_nt_xent(views, TEMPERATURE))
    torch.testing.assert_close(
        naive_multicrop_nt_xent(views[:2], TEMPERATURE), naive_nt_xent(*views[:2], TEMPERATURE)
    )
    # the views of one image are positives of one another, so their order does not matter
    shuffled = [views[2], views[0], views[3], views[1]]
    torch.testing.assert_close(SimCLRLoss(TEMPERATURE)(*shuffled), SimCLRLoss(TEMPERATURE)(*views))


def test_simclr_global_crops_keep_the_pairs_with_a_global_crop():
    views = [randn(4, 6, seed=40 + c) for c in range(5)]
    for num_global in (1, 2, 3):
        torch.testing.assert_close(
            SimCLRLoss(TEMPERATURE, num_global)(*views),
            naive_multicrop_nt_xent(views, TEMPERATURE, num_global),
        )
        assert not torch.allclose(
            SimCLRLoss(TEMPERATURE, num_global)(*views), SimCLRLoss(TEMPERATURE)(*views)
        )
    # with C - 1 or more global crops no two local crops exist: every pair counts, bit for bit
    for num_global in (4, 5):
        assert torch.equal(SimCLRLoss(TEMPERATURE, num_global)(*views), SimCLRLoss(TEMPERATURE)(*views))
    # and so are the gradients
    local = [v.clone().requires_grad_(True) for v in views]
    SimCLRLoss(TEMPERATURE, 2)(*local).backward()
    alone = [v.clone().requires_grad_(True) for v in views]
    naive_multicrop_nt_xent(alone, TEMPERATURE, 2).backward()
    for got, want in zip(local, alone):
        torch.testing.assert_close(got.grad, want.grad)


@pytest.mark.parametrize("num_global", [0, 2])
@pytest.mark.parametrize("prior, beta", [(0.1, 0.0), (0.0, 0.5), (0.3, 1.0)])
def test_simclr_negative_corrections_match_the_papers_formulas(num_global, prior, beta):
    views = [randn(4, 6, seed=60 + c) for c in range(4)]
    local = [v.clone().requires_grad_(True) for v in views]
    loss = SimCLRLoss(TEMPERATURE, num_global, prior, beta)(*local)
    alone = [v.clone().requires_grad_(True) for v in views]
    want = naive_multicrop_nt_xent(alone, TEMPERATURE, num_global, prior, beta)
    torch.testing.assert_close(loss, want)
    assert not torch.allclose(loss, SimCLRLoss(TEMPERATURE, num_global)(*views))
    loss.backward()
    want.backward()
    for got, expected in zip(local, alone):
        torch.testing.assert_close(got.grad, expected.grad)


def test_simclr_false_negative_prior_floor_keeps_loss_and_gradients_finite():
    # a large prior with a low temperature pushes most pairs' corrected sum under the floor
    # M e^{-1/t}, some by hundreds of orders of magnitude in float32
    views = [randn(6, 3, seed=70 + c, dtype=torch.float32) for c in range(3)]
    views[1] = views[0] + 0.01 * views[1]
    for temperature in (0.5, 0.01):
        local = [v.clone().requires_grad_(True) for v in views]
        loss = SimCLRLoss(temperature, 0, 0.9)(*local)
        loss.backward()
        assert torch.isfinite(loss) and all(torch.isfinite(v.grad).all() for v in local)
    doubles = [v.double() for v in views]
    torch.testing.assert_close(
        SimCLRLoss(0.5, 0, 0.9)(*doubles), naive_multicrop_nt_xent(doubles, 0.5, 0, 0.9)
    )


def _simclr_multicrop_worker(rank, world, views, num_global, prior, beta):
    local = [rank_slice(v, rank, world).clone().requires_grad_(True) for v in views]
    loss = SimCLRLoss(TEMPERATURE, num_global, prior, beta)(*local)
    loss.backward()
    return loss.detach(), [v.grad for v in local]


@pytest.mark.parametrize(
    "num_views, num_global, prior, beta", [(3, 0, 0.0, 0.0), (4, 1, 0.0, 0.0), (3, 0, 0.2, 0.5)]
)
def test_simclr_multicrop_distributed_equals_single_process(num_views, num_global, prior, beta):
    world = 2
    views = [randn(3 * world, 5, seed=30 + c) for c in range(num_views)]
    refs = [v.clone().requires_grad_(True) for v in views]
    ref = SimCLRLoss(TEMPERATURE, num_global, prior, beta)(*refs)
    ref.backward()
    results = run_on_ranks(_simclr_multicrop_worker, world, views, num_global, prior, beta)
    torch.testing.assert_close(sum(r[0] for r in results) / world, ref.detach(), rtol=1e-12, atol=1e-12)
    for rank, (_, grads) in enumerate(results):
        for got, want in zip(grads, refs):
            torch.testing.assert_close(
                got, world * rank_slice(want.grad, rank, world), rtol=1e-10, atol=1e-12
            )


def _simclr_worker(rank, world, z1, z2):
    a = rank_slice(z1, rank, world).clone().requires_grad_(True)
    b = rank_slice(z2, rank, world).clone().requires_grad_(True)
    loss = SimCLRLoss(TEMPERATURE)(a, b)
    loss.backward()
    return loss.detach(), a.grad, b.grad


@pytest.mark.parametrize("world", [2, 3])
def test_simclr_distributed_equals_single_process(world):
    z1, z2 = randn(4 * world, 7, seed=3), randn(4 * world, 7, seed=4)
    ref1, ref2 = z1.clone().requires_grad_(True), z2.clone().requires_grad_(True)
    ref = SimCLRLoss(TEMPERATURE)(ref1, ref2)
    ref.backward()
    results = run_on_ranks(_simclr_worker, world, z1, z2)
    torch.testing.assert_close(sum(r[0] for r in results) / world, ref.detach(), rtol=1e-12, atol=1e-12)
    for rank, (_, g1, g2) in enumerate(results):
        torch.testing.assert_close(g1, world * rank_slice(ref1.grad, rank, world), rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(g2, world * rank_slice(ref2.grad, rank, world), rtol=1e-10, atol=1e-12)
        # The negatives of the other ranks matter: the purely local loss differs.
        local = SimCLRLoss(TEMPERATURE)(rank_slice(z1, rank, world), rank_slice(z2, rank, world))
        assert not torch.allclose(local, results[rank][0])


def _projector(seed=0):
    torch.manual_seed(seed)
    return nn.Linear(6, 5).double()


def _simclr_ddp_worker(rank, world, x1, x2):
    model = DDP(_projector())
    loss = SimCLRLoss(TEMPERATURE)(model(rank_slice(x1, rank, world)), model(rank_slice(x2, rank, world)))
    loss.backward()
    return [p.grad for p in model.parameters()]


def test_simclr_ddp_averaged_gradient_equals_single_process_gradient():
    world = 2
    x1, x2 = randn(3 * world, 6, seed=5), randn(3 * world, 6, seed=6)
    model = _projector()
    SimCLRLoss(TEMPERATURE)(model(x1), model(x2)).backward()
    for rank_grads in run_on_ranks(_simclr_ddp_worker, world, x1, x2):
        for got, want in zip(rank_grads, [p.grad for p in model.parameters()]):
            torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)


def test_simclr_errors():
    with pytest.raises(ValueError, match="temperature must be positive"):
        SimCLRLoss(0.0)
    with pytest.raises(ValueError, match="equal shape"):
        SimCLRLoss(0.1)(randn(4, 3), randn(5, 3))
    with pytest.raises(ValueError, match="two or more"):
        SimCLRLoss(0.1)(randn(4, 3))
    with pytest.raises(ValueError, match="num_global_crops must be >= 0"):
        SimCLRLoss(0.1, -1)
    for prior in (-0.1, 1.0):
        with pytest.raises(ValueError, match="false_negative_prior must lie in"):
            SimCLRLoss(0.1, 0, prior)
    with pytest.raises(ValueError, match="hardness must be >= 0"):
        SimCLRLoss(0.1, 0, 0.0, -1.0)


# ---------------------------------------------------------------------------------------- Sinkhorn


def test_sinkhorn_matches_swav_algorithm_and_marginals():
    scores = F.normalize(randn(12, 5, seed=7), dim=1)  # cosine-like scores in [-1, 1]
    codes = sinkhorn_knopp(scores, epsilon=0.05, iterations=3)
    torch.testing.assert_close(codes, naive_sinkhorn(scores, 0.05, 3), rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(codes.sum(1), torch.ones(12, dtype=torch.float64))
    many = sinkhorn_knopp(scores, epsilon=0.05, iterations=200)  # converged: equipartition
    torch.testing.assert_close(many.sum(0), torch.full((5,), 12 / 5, dtype=torch.float64))


def _sinkhorn_worker(rank, world, scores, sizes):
    start = sum(sizes[:rank])
    return sinkhorn_knopp(scores[start : start + sizes[rank]], epsilon=0.05, iterations=3)


@pytest.mark.parametrize("world, sizes", [(2, [5, 5]), (3, [4, 7, 2])])
def test_sinkhorn_distributed_equals_single_process(world, sizes):
    # Ranks may hold different numbers of rows (e.g. queues): marginals are global regardless.
    scores = F.normalize(randn(sum(sizes), 6, seed=8, dtype=torch.float32), dim=1) * 3
    results = run_on_ranks(_sinkhorn_worker, world, scores, sizes)
    expected = sinkhorn_knopp(scores, epsilon=0.05, iterations=3)
    torch.testing.assert_close(torch.cat(results), expected, rtol=1e-5, atol=1e-7)
    local = sinkhorn_knopp(scores[: sizes[0]], epsilon=0.05, iterations=3)
    assert not torch.allclose(local, results[0], rtol=1e-3)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_sinkhorn_low_precision_scores_are_finite_and_close_to_fp32(dtype):
    scores = F.normalize(randn(16, 8, seed=9, dtype=torch.float32), dim=1)
    low = scores.to(dtype)
    codes = sinkhorn_knopp(low, epsilon=0.05, iterations=3)
    assert codes.dtype == torch.float32 and torch.isfinite(codes).all()
    # Computed in fp32 from the rounded scores: equal to the float64 algorithm on those values.
    torch.testing.assert_close(codes.double(), naive_sinkhorn(low.double(), 0.05, 3), rtol=1e-5, atol=1e-6)
    # And close to the codes of the unrounded scores.
    torch.testing.assert_close(codes, sinkhorn_knopp(scores, 0.05, 3), rtol=0.1, atol=0.02)


def test_sinkhorn_global_max_shift_prevents_overflow():
    # Scores near 6 with epsilon 0.05: exp(120) overflows fp32 (and bf16) without the shift.
    scores = (6 + 0.5 * F.normalize(randn(10, 4, seed=10, dtype=torch.float32), dim=1)).bfloat16()
    assert torch.isinf(torch.exp(scores.float() / 0.05)).any()
    codes = sinkhorn_knopp(scores, epsilon=0.05, iterations=3)
    torch.testing.assert_close(codes.double(), naive_sinkhorn(scores.double(), 0.05, 3), rtol=1e-5, atol=1e-6)


def test_sinkhorn_underflow_gives_zero_codes_not_nan():
    # With a score range / epsilon beyond ~87, exp underflows in fp32 for samples far below the
    # global max: those samples get all-zero codes (no target), the others still sum to one.
    scores = F.normalize(randn(10, 4, seed=10, dtype=torch.float32), dim=1)
    codes = sinkhorn_knopp(scores, epsilon=0.005, iterations=3)
    assert torch.isfinite(codes).all()
    sums = codes.sum(1)
    assert ((sums - 1).abs() < 1e-5).logical_or(sums == 0).all() and (sums > 0).any()


# -------------------------------------------------------------------------------------------- SwAV


def swav_loss(**kw):
    args = dict(temperature=TEMPERATURE, epsilon=0.05, sinkhorn_iterations=3, crops_for_assign=[0, 1])
    return SwAVLoss(**{**args, **kw})


def crop_scores(num_crops, n, k, seed=11):
    return [F.normalize(randn(n, k, seed=seed + c), dim=1) for c in range(num_crops)]


def test_swav_matches_formula_with_multicrop_and_targets_without_gradient():
    scores = [s.requires_grad_(True) for s in crop_scores(4, 6, 5)]
    loss = swav_loss()(scores)
    torch.testing.assert_close(loss, naive_swav(scores, TEMPERATURE, 0.05, 3, [0, 1]))
    loss.backward()
    # Gradient only through the predictions: d/ds_t of -sum q log softmax(s_t / T) = (p_t - q) / T
    # summed over the assign crops s != t, each / (num_crops - 1) / N / len(crops_for_assign).
    q0 = naive_sinkhorn(scores[0].detach(), 0.05, 3)
    q1 = naive_sinkhorn(scores[1].detach(), 0.05, 3)
    p3 = torch.softmax(scores[3].detach() / TEMPERATURE, 1)
    expected = ((p3 - q0) + (p3 - q1)) / TEMPERATURE / 3 / 6 / 2
    torch.testing.assert_close(scores[3].grad, expected)


def test_swav_several_prototype_layers_average():
    layer_a, layer_b = crop_scores(2, 5, 4, seed=1), crop_scores(2, 5, 7, seed=2)
    loss = swav_loss()([layer_a, layer_b])
    torch.testing.assert_close(loss, (swav_loss()(layer_a) + swav_loss()(layer_b)) / 2)


def test_swav_bf16_scores_give_a_finite_loss_close_to_fp32():
    scores = crop_scores(2, 8, 6)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        low = swav_loss()([s.float().bfloat16() for s in scores])
    assert low.dtype == torch.float32 and torch.isfinite(low)
    torch.testing.assert_close(low.double(), swav_loss()(scores), rtol=0.02, atol=0.0)


def _swav_worker(rank, world, scores, crops_for_assign):
    local = [rank_slice(s, rank, world).clone().requires_grad_(True) for s in scores]
    loss = swav_loss(crops_for_assign=crops_for_assign)(local)
    loss.backward()
    return loss.detach(), [s.grad for s in local]


@pytest.mark.parametrize("world", [2, 3])
def test_swav_distributed_equals_single_process(world):
    scores = [s.requires_grad_(True) for s in crop_scores(3, 4 * world, 5)]
    ref = swav_loss(crops_for_assign=[0, 2])(scores)
    ref.backward()
    plain = [s.detach() for s in scores]
    results = run_on_ranks(_swav_worker, world, plain, [0, 2])
    torch.testing.assert_close(sum(r[0] for r in results) / world, ref.detach(), rtol=1e-10, atol=1e-12)
    for rank, (_, grads) in enumerate(results):
        for got, s in zip(grads, scores):
            torch.testing.assert_close(got, world * rank_slice(s.grad, rank, world), rtol=1e-10, atol=1e-12)


def test_swav_queue_starts_at_epoch_fills_then_joins_sinkhorn():
    n, k, d, length = 4, 5, 3, 8
    loss = swav_loss(queue_length=length, start_queue_at_epoch=1)
    weight = F.normalize(randn(k, d, seed=20), dim=1)
    steps = [[F.normalize(randn(n, d, seed=30 + 2 * i + c), dim=1) for c in range(2)] for i in range(4)]
    scores = [[e @ weight.t() for e in emb] for emb in steps]

    assert loss(scores[0]) is not None and loss.queue is None  # epoch 0: no queue, no embeddings needed
    loss.set_epoch(1)
    with pytest.raises(ValueError, match="pass the per-crop embeddings"):
        loss(scores[0])
    for i in range(2):  # fills the queue; not yet used
        torch.testing.assert_close(
            loss(scores[i], steps[i], weight), naive_swav(scores[i], TEMPERATURE, 0.05, 3, [0, 1])
        )
    assert loss.queue_filled == length
    # Newest first: step 1's embeddings, then step 0's, per assign crop.
    torch.testing.assert_close(loss.queue[1], torch.cat([steps[1][1], steps[0][1]]))
    without_prototypes = loss(scores[2], steps[2])  # queue full but nothing to score it with
    torch.testing.assert_close(without_prototypes, naive_swav(scores[2], TEMPERATURE, 0.05, 3, [0, 1]))
    queued = [loss.queue[i] @ weight.t() for i in range(2)]
    expected = naive_swav(scores[3], TEMPERATURE, 0.05, 3, [0, 1], extra=queued)
    torch.testing.assert_close(loss(scores[3], steps[3], weight), expected)
    assert not torch.allclose(expected, naive_swav(scores[3], TEMPERATURE, 0.05, 3, [0, 1]))

    restored = swav_loss(queue_length=length, start_queue_at_epoch=1)
    restored.load_state_dict(loss.state_dict())
    assert restored.epoch == 1 and restored.queue_filled == length
    torch.testing.assert_close(restored.queue, loss.queue)


def test_swav_errors():
    with pytest.raises(ValueError, match="temperature > 0"):
        swav_loss(epsilon=0.0)
    with pytest.raises(ValueError, match="distinct crop indices"):
        swav_loss(crops_for_assign=[0, 0])
    with pytest.raises(ValueError, match="out of range for 2 crops"):
        swav_loss(crops_for_assign=[0, 2])(crop_scores(2, 4, 3))
    with pytest.raises(ValueError, match=">= 2 crops"):
        swav_loss()(crop_scores(1, 4, 3))
    with pytest.raises(ValueError, match="valid names"):
        build_loss(_loss_cfg("moco_loss"))


# ---------------------------------------------------------------------------------------- criteria


def _loss_cfg(name, **swav):
    cfg = get_defaults().LOSS
    cfg.NAME = name
    for key, value in swav.items():
        cfg.swav_loss[key] = value
    return cfg


@pytest.fixture
def plain_sharding_helpers(monkeypatch):
    """On unsharded models params_of / gathered are parameters() and a null context; provide
    them until vistrain.fsdp exports its own (then the real ones are exercised)."""
    if not hasattr(vistrain.fsdp, "params_of"):
        monkeypatch.setattr(vistrain.fsdp, "params_of", lambda m: m.parameters(), raising=False)
    if not hasattr(vistrain.fsdp, "gathered"):
        monkeypatch.setattr(vistrain.fsdp, "gathered", lambda m: contextlib.nullcontext(), raising=False)


def test_simclr_criterion_splits_views():
    criterion = build_loss(_loss_cfg("simclr_loss"))
    z = randn(8, 5, seed=12)
    torch.testing.assert_close(criterion(z, num_crops=2), SimCLRLoss(TEMPERATURE)(z[:4], z[4:]))
    torch.testing.assert_close(criterion(z, num_crops=4), SimCLRLoss(TEMPERATURE)(*z.chunk(4)))
    with pytest.raises(ValueError, match="2 or more crops"):
        criterion(z, num_crops=1)
    with pytest.raises(ValueError, match=r"\(3N, D\) embedding"):
        criterion(z, num_crops=3)
    criterion.before_optimizer_step(nn.Linear(2, 2), 0)  # no-ops
    criterion.after_optimizer_step(nn.Linear(2, 2))


def test_swav_criterion_splits_crops_and_layers():
    criterion = build_loss(_loss_cfg("swav_loss", crops_for_assign=[1]))
    head = SwAVHead([6, 8, 4], use_bn=True, nmb_prototypes=[5, 3])
    z, scores = head(randn(3 * 4, 6, seed=13).float())
    layers = [[s[c * 4 : (c + 1) * 4] for c in range(3)] for s in scores]
    expected = swav_loss(crops_for_assign=[1])(layers)
    torch.testing.assert_close(criterion((z, scores), num_crops=3), expected)
    with pytest.raises(ValueError, match="do not split into 5 equal crops"):
        criterion((z, scores), num_crops=5)


class Wrapper(nn.Module):  # stands for DDP(model) / a sharded root: prototypes found via modules()
    def __init__(self, module):
        super().__init__()
        self.module = module


def test_swav_criterion_freezes_then_normalises_prototypes(plain_sharding_helpers):
    criterion = build_loss(_loss_cfg("swav_loss", freeze_prototypes_niters=2))
    model = Wrapper(SwAVHead([6, 8, 4], use_bn=False, nmb_prototypes=[5, 3]))
    prototypes = list(model.module.prototypes)
    for iteration in range(3):
        model.zero_grad()
        z, scores = model.module(randn(8, 6, seed=iteration).float())
        criterion((z, scores), num_crops=2).backward()
        criterion.before_optimizer_step(model, iteration)
        frozen = iteration < 2
        assert all((p.weight.grad is None) == frozen for p in prototypes), iteration
        assert model.module.projection.layers[0].weight.grad is not None
    with torch.no_grad():
        for p in prototypes:
            p.weight.mul_(2.5)
    criterion.after_optimizer_step(model)
    for p in prototypes:
        torch.testing.assert_close(p.weight.norm(dim=1), torch.ones(p.weight.shape[0]))
    assert criterion.prototype_weights is None  # no queue configured: no copy kept
    with pytest.raises(ValueError, match="no SwAVPrototypes"):
        criterion.after_optimizer_step(nn.Linear(2, 2))


def test_swav_criterion_scores_queue_with_prototypes_of_last_step(plain_sharding_helpers):
    criterion = build_loss(_loss_cfg("swav_loss", queue_length=4))
    head = SwAVHead([6, 8, 4], use_bn=False, nmb_prototypes=[5])
    criterion.set_epoch(0)
    for step in range(2):  # batch of 2 images x 2 crops: two steps fill a queue of 4
        criterion(head(randn(4, 6, seed=step).float()), num_crops=2)
    criterion.after_optimizer_step(head)
    weight = head.prototypes[0].weight.detach()
    torch.testing.assert_close(criterion.prototype_weights[0], weight)
    z, (scores,) = head(randn(4, 6, seed=5).float())
    queued = [criterion.loss.queue[i] @ weight.t() for i in range(2)]
    layers = [scores[:2], scores[2:]]
    expected = naive_swav(
        [s.double() for s in layers], TEMPERATURE, 0.05, 3, [0, 1], [q.double() for q in queued]
    )
    torch.testing.assert_close(criterion((z, [scores]), num_crops=2).double(), expected, rtol=1e-5, atol=1e-6)
    assert math.isfinite(expected.item())


def _train_swav_head(model, criterion, batches, lr=0.5):
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    losses = []
    for iteration, crops in enumerate(batches):
        optimizer.zero_grad()
        loss = criterion(model(torch.cat(crops)), num_crops=len(crops))
        loss.backward()
        criterion.before_optimizer_step(model, iteration)
        optimizer.step()
        criterion.after_optimizer_step(model)
        losses.append(loss.detach())
    return torch.stack(losses)


def _swav_setup(seed=0):
    torch.manual_seed(seed)
    head = SwAVHead([6, 8, 4], use_bn=False, nmb_prototypes=[5, 3])
    return head, build_loss(_loss_cfg("swav_loss", freeze_prototypes_niters=1))


def _sharded_swav_worker(rank, world, batches):
    from vistrain.fsdp import auto_wrap, by_class
    from vistrain.fsdp.ownership import clean_name
    from vistrain.methods.swav import SwAVPrototypes

    head, criterion = _swav_setup()
    model = auto_wrap(head, by_class({SwAVPrototypes: {}}))  # each prototype layer its own unit
    local = [[rank_slice(c, rank, world) for c in crops] for crops in batches]
    losses = _train_swav_head(model, criterion, local)
    return losses, {clean_name(k): v for k, v in model.state_dict().items()}


def test_swav_criterion_on_sharded_prototypes_equals_single_process():
    # Prototypes frozen for step 0, trained at step 1, renormalised after each step: the sharded
    # run (real vistrain.fsdp, gloo) ends with the parameters of one process on the whole batch.
    world = 2
    batches = [
        [randn(4 * world, 6, seed=40 + 2 * i + c, dtype=torch.float32) for c in range(2)] for i in range(2)
    ]
    results = run_on_ranks(_sharded_swav_worker, world, batches)
    head, criterion = _swav_setup()
    start = {k: v.clone() for k, v in head.state_dict().items()}
    ref_losses = _train_swav_head(head, criterion, batches)
    torch.testing.assert_close(sum(r[0] for r in results) / world, ref_losses)
    state = results[0][1]
    assert set(state) == set(head.state_dict())
    for key, value in head.state_dict().items():
        torch.testing.assert_close(state[key], value, msg=key)
        assert not torch.equal(value, start[key]), key  # every parameter moved (prototypes at step 1)
