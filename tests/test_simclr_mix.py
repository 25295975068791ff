"""i-Mix for SimCLR (``LOSS.simclr_loss.mix_alpha``): the mixed loss against a loop over anchors,
on 2 gloo ranks against one process, the input mixing, the criterion's hand-over and the config's
refusals."""

import pytest
import torch
import torch.nn.functional as F

from vistrain.config import ConfigError
from vistrain.distributed.testing import run_on_ranks
from vistrain.losses import SimCLRLoss
from vistrain.losses.simclr import mix_crops
from vistrain.methods import build_method, check_config, load_config

TEMPERATURE = 0.5


def randn(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def naive_mixed_nt_xent(views, lam, partner, temperature):
    """Loop over anchors: keys are the views 1..C-1 of every image; view 0 of image i is mixed,
    its pair terms weighted lam_i on image i's keys and 1 - lam_i on partner(i)'s."""
    num_views, n = len(views), views[0].shape[0]
    z = [F.normalize(v, dim=1) for v in views]

    def pair(anchor, positive, negatives):
        s_p = anchor @ positive / temperature
        s_k = torch.stack([anchor @ k / temperature for k in negatives])
        return torch.logaddexp(s_p, torch.logsumexp(s_k, 0)) - s_p

    total = 0.0
    for c in range(num_views):
        for i in range(n):
            images, weights = ([i, int(partner[i])], [lam[i], 1 - lam[i]]) if c == 0 else ([i], [1.0])
            negatives = [z[d][j] for d in range(1, num_views) for j in range(n) if j not in images]
            for image, weight in zip(images, weights):
                positives = [z[d][image] for d in range(1, num_views) if (d, image) != (c, i)]
                total = total + weight * sum(pair(z[c][i], p, negatives) for p in positives) / len(positives)
    return total / (num_views * n)


def test_mixed_loss_and_gradients_match_the_loop():
    views = [randn(5, 6, seed=c) for c in range(4)]
    lam = torch.tensor([0.9, 0.2, 0.5, 1.0, 0.35], dtype=torch.float64)
    partner = torch.tensor([3, 0, 4, 1, 2])
    local = [v.clone().requires_grad_(True) for v in views]
    loss = SimCLRLoss(TEMPERATURE)(*local, mix=(lam, partner))
    alone = [v.clone().requires_grad_(True) for v in views]
    want = naive_mixed_nt_xent(alone, lam, partner, TEMPERATURE)
    torch.testing.assert_close(loss, want)
    loss.backward()
    want.backward()
    for got, expected in zip(local, alone):
        torch.testing.assert_close(got.grad, expected.grad)
    # the mixed anchors' virtual labels matter: another partner gives another loss
    assert not torch.allclose(loss, SimCLRLoss(TEMPERATURE)(*views, mix=(lam, partner.roll(1))))


def _mixed_worker(rank, world, views, lam, partner):
    n = views[0].shape[0] // world
    part = slice(rank * n, (rank + 1) * n)
    local = [v[part].clone().requires_grad_(True) for v in views]
    loss = SimCLRLoss(TEMPERATURE)(*local, mix=(lam[part], partner[part] - rank * n))
    loss.backward()
    return loss.detach(), [v.grad for v in local]


def test_mixed_loss_on_two_ranks_equals_one_process():
    world, n = 2, 3
    views = [randn(world * n, 5, seed=10 + c) for c in range(3)]
    lam = torch.rand(world * n, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    partner = torch.tensor([2, 0, 1, 4, 5, 3])  # each rank mixes its own images
    refs = [v.clone().requires_grad_(True) for v in views]
    ref = SimCLRLoss(TEMPERATURE)(*refs, mix=(lam, partner))
    ref.backward()
    results = run_on_ranks(_mixed_worker, world, views, lam, partner)
    torch.testing.assert_close(sum(r[0] for r in results) / world, ref.detach(), rtol=1e-12, atol=1e-12)
    for rank, (_, grads) in enumerate(results):
        for got, want in zip(grads, refs):
            torch.testing.assert_close(
                got, world * want.grad[rank * n : (rank + 1) * n], rtol=1e-10, atol=1e-12
            )


def test_mix_crops_mixes_pairs_and_keeps_channels_last():
    torch.manual_seed(0)
    crops = torch.randn(6, 3, 8, 8).contiguous(memory_format=torch.channels_last)
    mixed, lam, partner = mix_crops(crops, 1.0)
    assert mixed.is_contiguous(memory_format=torch.channels_last)
    assert sorted(partner.tolist()) == list(range(6)) and ((lam > 0) & (lam < 1)).all()
    want = lam.view(6, 1, 1, 1) * crops + (1 - lam.view(6, 1, 1, 1)) * crops[partner]
    torch.testing.assert_close(mixed, want)


def _criterion(*overrides):
    cfg = load_config(["config=regnet_fsdp", "config.DATA.TRAIN.TRANSFORMS.NUM_CROPS=[2,2]", *overrides])
    return build_method(cfg)


def test_criterion_mixes_crop_zero_and_scores_it_with_its_virtual_labels():
    criterion = _criterion("config.LOSS.simclr_loss.mix_alpha=1.0")
    crops = [torch.randn(4, 3, 8, 8) for _ in range(3)]
    torch.manual_seed(3)
    student = criterion.student_crops(crops)
    assert student[1] is crops[1] and student[2] is crops[2] and not torch.equal(student[0], crops[0])
    lam, partner = criterion._mix
    embeddings = torch.randn(12, 5, dtype=torch.float64)
    want = SimCLRLoss(criterion.loss.temperature)(*embeddings.chunk(3), mix=(lam, partner))
    torch.testing.assert_close(criterion(embeddings, 3), want)
    with pytest.raises(ValueError, match="crops that student_crops mixed"):
        criterion(embeddings, 3)  # each mixing is scored once
    plain = _criterion()
    assert plain.student_crops(crops) is crops


@pytest.mark.parametrize(
    "overrides, message",
    [
        (
            ["config.LOSS.simclr_loss.mix_alpha=1.0", "config.LOSS.simclr_loss.hardness=0.5"],
            "mix_alpha=1.0 is not combined with hardness: set them to 0 or mix_alpha to 0",
        ),
        (
            ["config.LOSS.simclr_loss.mix_alpha=1.0", "config.DATA.TRAIN.TRANSFORMS.NUM_CROPS=[2]"],
            r"needs 3 or more crops per image .* makes 2: add crops or set mix_alpha to 0",
        ),
    ],
)
def test_config_refuses_mix_settings_it_cannot_score(overrides, message):
    with pytest.raises(ConfigError, match=message):
        build_method(load_config(["config=regnet_fsdp", *overrides]))


def test_config_check_refuses_a_negative_alpha():
    bad = load_config(["config=regnet_fsdp", "config.LOSS.simclr_loss.mix_alpha=-1.0"])
    with pytest.raises(ConfigError, match="LOSS.simclr_loss.mix_alpha must be >= 0; got -1.0"):
        check_config(bad, lambda: None)


def test_loss_refuses_mixing_it_cannot_score():
    views = [randn(4, 3, seed=c) for c in range(3)]
    mix = (torch.full((4,), 0.5, dtype=torch.float64), torch.arange(4))
    with pytest.raises(ValueError, match="3 or more views"):
        SimCLRLoss(TEMPERATURE)(*views[:2], mix=mix)
    with pytest.raises(ValueError, match="not combined"):
        SimCLRLoss(TEMPERATURE, 0, 0.1)(*views, mix=mix)
    with pytest.raises(ValueError, match=r"shape \(4,\)"):
        SimCLRLoss(TEMPERATURE)(*views, mix=(mix[0][:3], mix[1]))
