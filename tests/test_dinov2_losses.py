"""DINOv2's terms as pure losses: iBOT's masked-patch loss and KoLeo against lightly 1.6.0's on the
same tensors (1e-6), in one process and on 2 gloo ranks against one process on the global batch
(KoLeo: per rank), and Sinkhorn-Knopp centring against DINOv2's formula written out; the batch
masks as DINOv2's collate draws them."""

import pytest
import torch
import torch.nn.functional as F
from lightly.loss import IBOTPatchLoss as LightlyIBOTPatchLoss
from lightly.loss import KoLeoLoss as LightlyKoLeoLoss

from vistrain.distributed.testing import run_on_ranks
from vistrain.losses.ibot import IBOTPatchLoss, ibot_cross_entropy, sinkhorn_knopp_teacher
from vistrain.losses.koleo import koleo_loss
from vistrain.models.masking import ibot_masks

K, GRID, STEPS = 12, (3, 4), 3
TEMPS = (0.0625, 0.046875, 0.078125)  # binary fractions: lightly holds the temperature in float32


def _batch(seed: int, images: int = 6):
    """Masks (B, h, w) with every count from 0 up, student logits (M, K) and teacher logits per step."""
    g = torch.Generator().manual_seed(seed)
    masks = torch.rand(images, *GRID, generator=g) < torch.linspace(0.0, 0.8, images).view(-1, 1, 1)
    m = int(masks.sum())
    student = [torch.randn(m, K, generator=g, dtype=torch.float64) for _ in range(STEPS)]
    teacher = [3 * torch.randn(m, K, generator=g, dtype=torch.float64) for _ in range(STEPS)]
    return masks, student, teacher


def _ours(masks, student, teacher, temps=TEMPS):
    loss_fn = IBOTPatchLoss(K, student_temp=0.1, center_momentum=0.9).double()
    losses, grads = [], []
    for s, t, temp in zip(student, teacher, temps):
        s = s.clone().requires_grad_(True)
        loss = loss_fn(s, t, masks.flatten(1), temp)
        loss.backward()
        losses.append(loss.detach())
        grads.append(s.grad)
    return torch.stack(losses), torch.stack(grads), loss_fn.center.clone()


def _lightly(masks, student, teacher, temps=TEMPS):
    loss_fn = LightlyIBOTPatchLoss(output_dim=K, student_temp=0.1, center_momentum=0.9).double()
    losses, grads = [], []
    for s, t, temp in zip(student, teacher, temps):
        s = s.clone().requires_grad_(True)
        loss = loss_fn(t, s, masks, teacher_temp=temp)
        loss.backward()
        losses.append(loss.detach())
        grads.append(s.grad)
    return torch.stack(losses), torch.stack(grads), loss_fn.center.value.clone()


def test_ibot_patch_loss_equals_lightly_with_its_centre_over_steps():
    masks, student, teacher = _batch(0)
    assert 0 in masks.flatten(1).sum(1).tolist()  # an unmasked image counts in the mean over images
    ours, lightly = _ours(masks, student, teacher), _lightly(masks, student, teacher)
    for a, b in zip(ours, lightly):
        torch.testing.assert_close(a, b.view_as(a), rtol=1e-6, atol=1e-9)
    assert ours[2].abs().max() > 0.1  # the centre moved and was used


def test_ibot_cross_entropy_is_dinov2s_weighted_sum_written_out():
    masks, student, teacher = _batch(1)
    flat = masks.flatten(1)
    targets = F.softmax(teacher[0] / 0.04, dim=-1)
    want, row = 0.0, 0
    for b in range(flat.shape[0]):
        count = int(flat[b].sum())
        for _ in range(count):
            log_p = F.log_softmax(student[0][row] / 0.1, dim=-1)
            want += float(-(targets[row] * log_p).sum()) / count
            row += 1
    got = ibot_cross_entropy(student[0], targets, flat, 0.1)
    assert abs(got.item() - want / flat.shape[0]) < 1e-9
    with pytest.raises(ValueError, match="must mark the"):
        ibot_cross_entropy(student[0][1:], targets[1:], flat, 0.1)


def _ibot_on_rank(rank, world, seed, lightly):
    masks, student, teacher = _batch(seed + rank)  # each rank its own images, its own masked counts
    return (_lightly if lightly else _ours)(masks, student, teacher)


def _global_batch(seed, world):
    parts = [_batch(seed + rank) for rank in range(world)]
    masks = torch.cat([p[0] for p in parts])
    student = [torch.cat([p[1][i] for p in parts]) for i in range(STEPS)]
    teacher = [torch.cat([p[2][i] for p in parts]) for i in range(STEPS)]
    return masks, student, teacher


def test_ibot_on_two_ranks_equals_one_process_on_the_global_batch():
    """The mean of the ranks' losses (what averaged gradients train) is the global batch's loss; the
    centre is the global batch's, with unequal masked counts per rank; each rank's input gradients
    are world x the global loss's (DDP averages them)."""
    masks, student, teacher = _global_batch(10, 2)
    losses, grads, centre = _ours(masks, student, teacher)
    ranks = run_on_ranks(_ibot_on_rank, 2, 10, False)
    assert _batch(10)[0].sum() != _batch(11)[0].sum()
    torch.testing.assert_close(sum(r[0] for r in ranks) / 2, losses, rtol=1e-6, atol=1e-9)
    torch.testing.assert_close(torch.cat([r[1] for r in ranks], dim=1) / 2, grads, rtol=1e-6, atol=1e-9)
    for _, _, rank_centre in ranks:
        torch.testing.assert_close(rank_centre, centre, rtol=1e-6, atol=1e-9)


def test_ibot_on_two_ranks_equals_lightly_on_two_ranks_when_ranks_mask_alike():
    """lightly's centre averages the ranks' own means: the global mean when the counts agree."""
    seed = next(s for s in range(100, 200) if _batch(s)[0].sum() == _batch(s + 1)[0].sum())
    ours, lightly = run_on_ranks(_ibot_on_rank, 2, seed, False), run_on_ranks(_ibot_on_rank, 2, seed, True)
    for mine, theirs in zip(ours, lightly):
        for a, b in zip(mine, theirs):
            torch.testing.assert_close(a, b.view_as(a), rtol=1e-6, atol=1e-9)


# -- KoLeo ---------------------------------------------------------------------------------------
def test_koleo_equals_lightly_value_and_gradient():
    x = torch.randn(9, 5, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    ours, theirs = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    a, b = koleo_loss(ours), LightlyKoLeoLoss()(theirs)
    a.backward(), b.backward()
    torch.testing.assert_close(a, b.to(a.dtype), rtol=1e-6, atol=0)
    torch.testing.assert_close(ours.grad, theirs.grad.to(ours.grad.dtype), rtol=1e-6, atol=1e-9)
    with pytest.raises(ValueError, match="n >= 2"):
        koleo_loss(x[:1])


def _koleo_rows(rank):
    g = torch.Generator().manual_seed(5)
    base = torch.randn(6, 8, generator=g)
    # rank 1's rows are rank 0's a little moved: across ranks every row has a near twin
    return base if rank == 0 else base + 0.01 * torch.randn(6, 8, generator=g)


def _koleo_on_rank(rank, world):
    return koleo_loss(_koleo_rows(rank))


def test_koleo_is_per_rank_on_two_ranks():
    values = run_on_ranks(_koleo_on_rank, 2)
    for rank, value in enumerate(values):
        assert value == koleo_loss(_koleo_rows(rank))  # each rank's own images, bit for bit
    whole = koleo_loss(torch.cat([_koleo_rows(0), _koleo_rows(1)]))
    assert whole > max(values) + 1.0  # the global batch's twins would be the neighbours


# -- Sinkhorn-Knopp centring ---------------------------------------------------------------------
def dinov2_sinkhorn_knopp_teacher(teacher_output, teacher_temp, n_iterations=3):
    """DINOv2's ``sinkhorn_knopp_teacher`` (dino_clstoken_loss.py), one process, written out."""
    q = torch.exp(teacher_output / teacher_temp).t()
    b, k = q.shape[1], q.shape[0]
    q /= torch.sum(q)
    for _ in range(n_iterations):
        q /= torch.sum(q, dim=1, keepdim=True)
        q /= k
        q /= torch.sum(q, dim=0, keepdim=True)
        q /= b
    q *= b
    return q.t()


def test_sinkhorn_knopp_centring_equals_dinov2s_formula():
    logits = torch.randn(10, K, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    got = sinkhorn_knopp_teacher(logits, 0.07)
    torch.testing.assert_close(got, dinov2_sinkhorn_knopp_teacher(logits, 0.07), rtol=1e-6, atol=1e-9)
    torch.testing.assert_close(got.sum(1), torch.ones(10, dtype=torch.float64))
    low = sinkhorn_knopp_teacher(logits.float(), 0.07)  # float32 rounds only (a max is subtracted first)
    torch.testing.assert_close(low, got.float(), rtol=1e-5, atol=1e-7)


SK_ROWS = (7, 3)  # iBOT's case: the ranks hold different numbers of masked patches


def _sk_rows():
    g = torch.Generator().manual_seed(4)
    return torch.randn(sum(SK_ROWS), K, generator=g, dtype=torch.float64).split(SK_ROWS)


def _sk_on_rank(rank, world):
    return sinkhorn_knopp_teacher(_sk_rows()[rank], 0.05)


def test_sinkhorn_knopp_on_two_ranks_equals_one_process_on_the_global_batch():
    want = dinov2_sinkhorn_knopp_teacher(torch.cat(_sk_rows()), 0.05)
    got = torch.cat(run_on_ranks(_sk_on_rank, 2))
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-9)


def test_a_rank_without_masked_patches_takes_part_in_sinkhorn_knopp():
    assert sinkhorn_knopp_teacher(torch.zeros(0, K), 0.05).shape == (0, K)


# -- the batch masks -----------------------------------------------------------------------------
def test_ibot_masks_follow_dinov2s_collate():
    g = torch.Generator().manual_seed(0)
    masks = ibot_masks(16, (7, 7), (0.1, 0.5), 0.5, g)
    counts = masks.sum(1)
    masked = sorted(c for c in counts.tolist() if c)
    assert masks.shape == (16, 49) and len(masked) == 8  # half of the images
    # stratified: the i-th of 8 draws its ratio from the i-th eighth of [0.1, 0.5]
    for i, count in enumerate(masked):
        assert int(49 * (0.1 + 0.05 * i)) <= count <= int(49 * (0.1 + 0.05 * (i + 1)))
    assert counts[:8].sum() not in (0, counts.sum())  # the masked images are shuffled in
    again = ibot_masks(16, (7, 7), (0.1, 0.5), 0.5, torch.Generator().manual_seed(0))
    assert torch.equal(masks, again)
    assert ibot_masks(3, (2, 2), (0.0, 0.0), 0.1, g).sum() == 1  # at least one patch of one image
    with pytest.raises(ValueError, match="ratio_range"):
        ibot_masks(4, (2, 2), (0.5, 0.1), 0.5, g)
