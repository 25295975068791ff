"""MSN: the loss against lightly 1.6.0's ``MSNLoss`` (a test-only oracle) on the same tensors, in one
process and on 2 gloo ranks against one process on the global batch (me-max and Sinkhorn-Knopp over
the global batch); the head, the criterion's crops and masks, the model's masked first run, and
the one-line config errors. The demo trains sharded = DDP and resumes from 2 ranks on 3 in
tests/test_joint_embedding_methods.py.

lightly's ``MSNLoss(temperature, sinkhorn_iterations, regularization_weight)`` with
``target_sharpen_temperature`` is ours with ``sharpen_temperature`` and ``me_max_weight``; its
me-max reads the rank's own anchors, so the ranks are compared with it on the global batch.
"""

import math
import re

import pytest
import torch
from lightly.loss import MSNLoss
from torch import nn

from vistrain.config import ConfigError
from vistrain.distributed.testing import run_on_ranks
from vistrain.losses.msn import me_max, msn_loss
from vistrain.methods import build_method, build_model, check_config, load_config
from vistrain.methods.msn import MSNOutput

VIEWS, K, D = 3, 7, 5
SETTINGS = [dict(sinkhorn_iterations=0, me_max_weight=1.0), dict(sinkhorn_iterations=3, me_max_weight=0.5)]
TOLERANCES = {torch.float64: dict(rtol=1e-9, atol=1e-11), torch.float32: dict(rtol=1e-6, atol=1e-6)}
TIGHT = dict(rtol=1e-10, atol=1e-12)  # the same computation, reordered: ranks against one process


def tensors(n, dtype=torch.float64, seed=0):
    """anchors (V N, D) view by view, targets (N, D), prototypes (K, D)."""
    g = torch.Generator().manual_seed(seed)
    targets = torch.randn(n, D, generator=g, dtype=dtype)
    anchors = targets.repeat(VIEWS, 1) + 0.7 * torch.randn(VIEWS * n, D, generator=g, dtype=dtype)
    return {"anchors": anchors, "targets": targets, "prototypes": torch.randn(K, D, generator=g, dtype=dtype)}


def rank_rows(t, rank, world):
    """This rank's images: its rows of every anchor view and of the targets; every prototype."""
    anchors = torch.cat([v.chunk(world)[rank] for v in t["anchors"].chunk(VIEWS)])
    return {"anchors": anchors, "targets": t["targets"].chunk(world)[rank], "prototypes": t["prototypes"]}


def value_and_grads(loss_fn, t):
    """The loss and its gradients with respect to the anchors and the prototypes."""
    anchors, prototypes = (t[k].clone().requires_grad_(True) for k in ("anchors", "prototypes"))
    loss = loss_fn(anchors, t["targets"], prototypes)
    return [loss.detach(), *torch.autograd.grad(loss, [anchors, prototypes])]


def ours(setting, temperature=0.1, sharpen=0.25):
    return lambda a, t, p: msn_loss(a, t, p, temperature, sharpen, **setting)


def lightly(setting, temperature=0.1, sharpen=0.25):
    oracle = MSNLoss(temperature, setting["sinkhorn_iterations"], setting["me_max_weight"])
    return lambda a, t, p: oracle(a, t, p, target_sharpen_temperature=sharpen)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("setting", SETTINGS)
def test_the_loss_equals_lightly(setting, dtype):
    """The value and the gradients of the anchors and the prototypes; the targets carry none."""
    t = tensors(8, dtype)
    for temperature, sharpen in ((0.1, 0.25), (0.2, 0.5)):
        got = value_and_grads(ours(setting, temperature, sharpen), t)
        want = value_and_grads(lightly(setting, temperature, sharpen), t)
        assert got[0].dtype == dtype
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w, **TOLERANCES[dtype])
    targets = t["targets"].clone().requires_grad_(True)
    loss = msn_loss(t["anchors"].clone().requires_grad_(True), targets, t["prototypes"])
    assert torch.autograd.grad(loss, targets, allow_unused=True) == (None,)
    with pytest.raises(
        ValueError, match=re.escape("anchors (V N, D) and targets (N, D), got (24, 5) and (7, 5)")
    ):
        msn_loss(t["anchors"], t["targets"][:7], t["prototypes"])


def test_me_max_is_zero_at_uniform_use_and_the_loss_runs_in_fp32_under_autocast():
    torch.testing.assert_close(me_max(torch.full((K,), 1 / K)), torch.tensor(0.0), rtol=0, atol=1e-6)
    torch.testing.assert_close(me_max(torch.eye(K)[0]), torch.tensor(math.log(K)))  # one prototype: log K
    t = tensors(4, torch.float32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = msn_loss(t["anchors"].bfloat16(), t["targets"].bfloat16(), t["prototypes"])
    assert got.dtype == torch.float32


# ------------------------------------------------------------------------------- gloo ranks


def _rank_losses(rank, world):
    t = rank_rows(tensors(4 * world), rank, world)
    return [value_and_grads(ours(setting), t) for setting in SETTINGS]


def test_two_ranks_equal_one_process_on_the_global_batch():
    """Mean of the per-rank losses = lightly's on the global batch; each rank's anchors get
    world_size x its rows' single-process gradient, the prototypes' mean over ranks (DDP's
    average) the single-process one: me-max and Sinkhorn-Knopp read the global batch."""
    world = 2
    results = run_on_ranks(_rank_losses, world)
    data = tensors(4 * world)
    for i, setting in enumerate(SETTINGS):
        value, anchors, prototypes = value_and_grads(lightly(setting), data)
        per_rank = [r[i] for r in results]
        torch.testing.assert_close(sum(r[0] for r in per_rank) / world, value, **TIGHT)
        torch.testing.assert_close(sum(r[2] for r in per_rank) / world, prototypes, **TIGHT)
        for rank, (_, got, _) in enumerate(per_rank):
            want = rank_rows(
                {"anchors": anchors, "targets": data["targets"], "prototypes": None}, rank, world
            )
            torch.testing.assert_close(got, world * want["anchors"], **TIGHT)


# ------------------------------------------------------------------------------- the method


def _tiny(*overrides):
    return load_config(["config=test/msn_tiny", *overrides])


def test_the_head_is_the_authors_with_fp32_prototypes():
    """init_model's projection (Linear, BN, GELU twice, Linear), then K prototypes drawn from
    U(-1/sqrt(D), 1/sqrt(D)); both outputs L2-normalised and float32 under autocast."""
    head = build_model(_tiny().MODEL).head
    kinds = [type(m).__name__ for m in head.projection.layers]
    assert kinds == ["Linear", "BatchNorm1d", "GELU", "Linear", "BatchNorm1d", "GELU", "Linear"]
    weight = head.prototypes.weight
    assert weight.shape == (8, 16) and weight.abs().max() <= 16**-0.5
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = head(torch.randn(6, 16))
    assert isinstance(out, MSNOutput) and out.embeddings.dtype == out.prototypes.dtype == torch.float32
    torch.testing.assert_close(out.prototypes.norm(dim=1), torch.ones(8))
    torch.testing.assert_close(out.embeddings.norm(dim=1), torch.ones(6))
    with pytest.raises(ConfigError, match=re.escape("MODEL.HEAD.NUM_PROTOTYPES must be positive, got 0")):
        build_model(_tiny("config.MODEL.HEAD.NUM_PROTOTYPES=0").MODEL)


def test_the_criterion_masks_the_first_anchors_and_scores_them_against_the_target():
    """The teacher sees crop 0, the student the others; ``keep`` covers the anchors of the
    first crops' size (12 of 16 patches), the focal crops go whole through the trunk; the loss is
    msn_loss with the section's values; the mask generator is saved with the criterion."""
    cfg = _tiny()
    torch.manual_seed(0)
    criterion, model = build_method(cfg), build_model(cfg.MODEL)
    crops = [
        torch.randn(3, 3, 16, 16),
        torch.randn(3, 3, 16, 16),
        torch.randn(3, 3, 8, 8),
        torch.randn(3, 3, 8, 8),
    ]
    assert criterion.teacher_crops(crops) == crops[:1] and criterion.student_crops(crops) == crops[1:]
    assert criterion.teacher_momentum == 0.9
    state = criterion.state_dict()
    keep = criterion.masking(crops[1:])["keep"]
    assert keep.shape == (3, 12)
    criterion.load_state_dict(state)
    assert torch.equal(criterion.masking(crops[1:])["keep"], keep)  # the generator restored
    model.eval()  # the BatchNorm statistics of one batch whatever the grouping
    out = model(crops[1:], keep=keep)
    trunk = model.trunk
    pooled = [trunk(crops[1], keep=keep)["avgpool"], trunk(torch.cat(crops[2:]))["avgpool"]]
    torch.testing.assert_close(out.embeddings, model.head(torch.cat(pooled)).embeddings)
    target = model(crops[:1])
    want = msn_loss(out.embeddings, target.embeddings, out.prototypes, 0.1, 0.25, 3, 1.0)
    assert criterion(out, 4, target) == want
    for output, crops_, teacher, message in (
        (out, 1, target, "a target crop and at least one anchor crop, got 1"),
        (out, 4, None, "needs the teacher's output"),
        (out.embeddings, 4, target, "the (embeddings, prototypes) of an msn head"),
    ):
        with pytest.raises(ValueError, match=re.escape(message)):
            criterion(output, crops_, teacher)
    assert build_method(_tiny("config.LOSS.msn_loss.mask_ratio=0")).masking(crops[1:]) == {}


@pytest.mark.parametrize(
    "overrides, line",
    [
        (["config.MODEL.TRUNK.NAME=regnet"],
         "LOSS.msn_loss.mask_ratio > 0 drops a ViT's patches: MODEL.TRUNK.NAME=regnet has no patch tokens"),
        (["config.DATA.TRAIN.TRANSFORMS.NUM_CROPS=[1]"], "LOSS.NAME=msn_loss takes 2 or more crops per image"),
        (["config.MODEL.HEAD.NAME=dino"], "LOSS.NAME=msn_loss reads a msn head: set MODEL.HEAD.NAME=msn (now dino)"),
        (["config.LOSS.msn_loss.mask_ratio=1.0"], "LOSS.msn_loss.mask_ratio must be < 1"),
        (["config.LOSS.msn_loss.sharpen_temperature=0"], "LOSS.msn_loss.sharpen_temperature must be > 0"),
        (["config.LOSS.msn_loss.momentum_teacher=2"], "LOSS.msn_loss.momentum_teacher is a probability"),
    ],
)  # fmt: skip
def test_a_config_msn_cannot_train_is_one_line(overrides, line):
    with pytest.raises(ConfigError, match=re.escape(line)) as error:
        check_config(_tiny(*overrides), lambda: None, files=False)
    assert "\n" not in str(error.value)


def test_the_prototypes_are_a_parameter_of_the_model_state():
    model = build_model(_tiny().MODEL)
    assert isinstance(model.head.prototypes.weight, nn.Parameter)
    assert model.state_dict()["head.prototypes.weight"].shape == (8, 16)
