"""DINO and BYOL against their papers' reference code written out, the centre's all-reduce on
real gloo ranks, the momentum and temperature schedules, and the method registry."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from vistrain.config import ConfigError
from vistrain.distributed.testing import run_on_ranks
from vistrain.losses import DINOLoss, byol_loss, cosine_momentum, symmetric_byol_loss, teacher_temperature
from vistrain.methods import build_method, build_model, check_config, load_config


# -- reference code (DINO's main_dino.py / utils.py, BYOL's paper), written out ---------------------
def dino_reference(student_output, teacher_output, center, ncrops, student_temp, teacher_temp, momentum):
    """facebookresearch/dino ``DINOLoss.forward`` + ``update_center`` (one process)."""
    student_out = (student_output / student_temp).chunk(ncrops)
    teacher_out = F.softmax((teacher_output - center) / teacher_temp, dim=-1).detach().chunk(2)
    total_loss, n_loss_terms = 0, 0
    for iq, q in enumerate(teacher_out):
        for v in range(len(student_out)):
            if v == iq:
                continue
            loss = torch.sum(-q * F.log_softmax(student_out[v], dim=-1), dim=-1)
            total_loss += loss.mean()
            n_loss_terms += 1
    total_loss /= n_loss_terms
    batch_center = torch.sum(teacher_output, dim=0, keepdim=True) / len(teacher_output)
    return total_loss, center * momentum + batch_center * (1 - momentum)


def dino_cosine_scheduler(base_value, final_value, epochs, niter_per_ep):
    """facebookresearch/dino ``utils.cosine_scheduler`` without warm-up."""
    iters = np.arange(epochs * niter_per_ep)
    return final_value + 0.5 * (base_value - final_value) * (1 + np.cos(np.pi * iters / len(iters)))


@pytest.mark.parametrize("ncrops", [2, 6])
def test_dino_loss_equals_the_reference_code(ncrops):
    torch.manual_seed(0)
    n, k = 5, 11
    loss = DINOLoss(k, student_temp=0.1, center_momentum=0.9)
    loss.center.copy_(torch.randn(1, k) * 0.1)
    center = loss.center.clone()
    for _ in range(3):  # the centre carries over between steps
        student = torch.randn(ncrops * n, k, requires_grad=True)
        teacher = torch.randn(2 * n, k)
        got = loss(list(student.chunk(ncrops)), list(teacher.chunk(2)), teacher_temp=0.04)
        ref_student = student.detach().clone().requires_grad_(True)
        want, center = dino_reference(ref_student, teacher, center, ncrops, 0.1, 0.04, 0.9)
        torch.testing.assert_close(got, want, rtol=1e-6, atol=0)
        torch.testing.assert_close(loss.center, center, rtol=1e-6, atol=1e-8)
        got.backward()
        want.backward()
        torch.testing.assert_close(student.grad, ref_student.grad, rtol=1e-5, atol=1e-9)


def _centre_on_rank(rank, world):
    torch.manual_seed(0)
    teacher = torch.randn(world, 2 * 3, 7)  # every rank's teacher outputs, the same on every rank
    loss = DINOLoss(7, center_momentum=0.8)
    loss(list(torch.randn(4 * 3, 7).chunk(4)), list(teacher[rank].chunk(2)), 0.05)
    return loss.center, teacher


def test_dino_centre_is_the_ema_of_the_global_batch_on_every_rank():
    results = run_on_ranks(_centre_on_rank, 2)
    teacher = results[0][1]
    want = 0.2 * teacher.reshape(-1, 7).mean(0, keepdim=True)  # (1 - m) * global mean, from zero
    for centre, _ in results:
        torch.testing.assert_close(centre, want, rtol=1e-6, atol=1e-8)


def test_teacher_temperature_warms_up_as_dino():
    ref = np.concatenate((np.linspace(0.04, 0.07, 30), np.ones(70) * 0.07))
    got = [teacher_temperature(e, 0.04, 0.07, 30) for e in range(100)]
    np.testing.assert_allclose(got, ref, rtol=1e-12)
    assert teacher_temperature(0, 0.02, 0.04, 0) == 0.04 and teacher_temperature(0, 0.02, 0.04, 1) == 0.02


def test_momentum_follows_dinos_cosine_schedule():
    ref = dino_cosine_scheduler(0.996, 1, 3, 7)
    got = [cosine_momentum(0.996, it, 21) for it in range(21)]
    np.testing.assert_allclose(got, ref, rtol=0, atol=1e-12)
    assert cosine_momentum(0.996, 21, 21) == 1.0


def test_byol_loss_equals_the_papers_formula():
    torch.manual_seed(0)
    p1, p2, z1, z2 = (torch.randn(6, 9) for _ in range(4))

    def paper(q, z):  # || q / ||q|| - z / ||z|| ||^2, mean over images
        return ((q / q.norm(dim=1, keepdim=True) - z / z.norm(dim=1, keepdim=True)) ** 2).sum(1).mean()

    torch.testing.assert_close(byol_loss(p1, z2), paper(p1, z2), rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(
        symmetric_byol_loss((p1, p2), (z1, z2)), paper(p1, z2) + paper(p2, z1), rtol=1e-6, atol=1e-7
    )
    # lightly's NegativeCosineSimilarity form: 2 + 2 * (-cos)
    neg_cos = -F.cosine_similarity(p1, z2, dim=1).mean()
    torch.testing.assert_close(byol_loss(p1, z2), 2 + 2 * neg_cos, rtol=1e-6, atol=1e-7)


# -- the registry ----------------------------------------------------------------------------
def test_a_method_needs_its_head():
    cfg = load_config(["config=test/dino_tiny", "config.MODEL.HEAD.NAME=simclr"])
    with pytest.raises(ConfigError, match="MODEL.HEAD.NAME=dino"):
        build_method(cfg)


@pytest.mark.parametrize(
    "name, crops, problem",
    [
        ("test/byol_tiny", "[2,2]", "takes exactly 2 crops per image"),
        ("regnet_fsdp", "[1]", "takes 2 or more crops per image"),
        ("regnet_fsdp", "[2,4]", None),  # SimCLR with multi-crop
        ("test/dino_tiny", "[2,6]", None),
    ],
)
def test_a_method_refuses_crop_counts_it_cannot_take_before_the_first_step(name, crops, problem):
    cfg = load_config([f"config={name}", f"config.DATA.TRAIN.TRANSFORMS.NUM_CROPS={crops}"])
    if problem is None:
        build_method(cfg)
        return
    with pytest.raises(ConfigError, match=problem) as error:
        build_method(cfg)
    assert "change NUM_CROPS" in str(error.value) and "\n" not in str(error.value)


@pytest.mark.parametrize("name, loss", [("regnet_fsdp", "simclr_loss"), ("test/dino_tiny", "dino_loss")])
def test_more_global_crops_than_crops_is_one_config_line(name, loss):
    cfg = load_config(
        [
            f"config={name}",
            "config.DATA.TRAIN.TRANSFORMS.NUM_CROPS=[2]",
            f"config.LOSS.{loss}.num_global_crops=3",
        ]
    )
    with pytest.raises(ConfigError, match=f"LOSS.{loss}.num_global_crops=3, .* makes 2 crops") as error:
        build_method(cfg)
    assert "at most 2" in str(error.value) and "\n" not in str(error.value)


def test_simclr_global_crops_reach_the_loss():
    cfg = load_config(["config=regnet_fsdp", "config.LOSS.simclr_loss.num_global_crops=2"])
    assert build_method(cfg).loss.num_global_crops == 2
    bad = load_config(["config=regnet_fsdp", "config.LOSS.simclr_loss.num_global_crops=-1"])
    with pytest.raises(ConfigError, match="LOSS.simclr_loss.num_global_crops must be >= 0; got -1"):
        check_config(bad, lambda: None)


@pytest.mark.parametrize("name", ["test/dino_tiny", "test/byol_tiny"])
def test_teacher_methods_route_crops(name):
    cfg = load_config([f"config={name}"])
    method = build_method(cfg)
    assert method.teacher_momentum == 0.9
    crops = [torch.randn(2, 3, 16, 16)] * 2 + [torch.randn(2, 3, 8, 8)] * 2
    assert len(method.student_crops(crops)) == 4
    assert len(method.teacher_crops(crops)) == (2 if "dino" in name else 4)


def test_dino_freezes_the_last_layer_in_the_first_epoch():
    cfg = load_config(["config=test/dino_tiny"])
    method, model = build_method(cfg), build_model(cfg.MODEL)
    method.set_epoch(0)
    assert [p.shape for p in method.frozen_params(model, 0)] == [torch.Size([32, 16])]
    method.set_epoch(1)
    assert method.frozen_params(model, 5) == []


def test_dino_last_layer_is_weight_normalised():
    cfg = load_config(["config=test/dino_tiny"])
    last = build_model(cfg.MODEL).head.last_layer
    x = torch.randn(3, 16)
    want = x @ (last.weight / last.weight.norm(dim=1, keepdim=True)).T
    torch.testing.assert_close(last(x), want)
    assert last.weight_g is None
    free = build_model(
        load_config(["config=test/dino_tiny", "config.MODEL.HEAD.NORM_LAST_LAYER=False"]).MODEL
    )
    last = free.head.last_layer
    with torch.no_grad():
        last.weight_g.mul_(3.0)
    want = 3.0 * x @ (last.weight / last.weight.norm(dim=1, keepdim=True)).T
    torch.testing.assert_close(last(x), want)
