"""DINO with DINOv2's terms (``vistrain/methods/dino.py``): the masks of the global crops only
through SSLModel, the head's class and patch logits, the loss as the sum of its terms, the
config's one-line errors, and the tiny recipe (iBOT, KoLeo, Sinkhorn-Knopp) sharded against DDP,
resumed on the same ranks (the same masks) and on three."""

import json
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from vistrain.benchmarks.weights import load_weights
from vistrain.checkpoint import consolidated_state_dict
from vistrain.config import ConfigError
from vistrain.distributed.testing import run_on_ranks
from vistrain.losses.dino import dino_cross_entropy
from vistrain.losses.ibot import ibot_cross_entropy, sinkhorn_knopp_teacher
from vistrain.losses.koleo import koleo_loss
from vistrain.methods import METHODS, build_method, build_model, load_config
from vistrain.methods.dino import DINOLastLayer, DINOTokens
from vistrain.models.masking import ibot_masked_bound, ibot_masks
from vistrain.planner.shape import ModelShapes, crops_of
from vistrain.training.resume import resume
from vistrain.training.trainer import _build, train


def _cfg(*overrides):
    return load_config(["config=test/dinov2_tiny", *overrides])


def _crops(seed=0, n=4):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(n, 3, side, side, generator=g) for side in (16, 16, 8, 8)]


def test_only_the_global_crops_are_masked_and_the_head_scores_their_masked_patches():
    cfg = _cfg()
    torch.manual_seed(0)
    model, criterion, crops = build_model(cfg.MODEL), build_method(cfg), _crops()
    masking = criterion.masking(crops)
    masks = masking["mask"]
    assert len(masks) == 2 and all(m.shape == (4, 16) for m in masks) and sum(m.sum() for m in masks) > 0
    out = model(crops, **masking)
    assert (
        isinstance(out, DINOTokens)
        and out.class_logits.shape == (16, 32)
        and out.class_tokens.shape == (16, 16)
    )
    # the global crops through the trunk with their masks, the local ones without
    global_seq = model.trunk(torch.cat(crops[:2]), mask=torch.cat(masks))["sequence"]
    local_seq = model.trunk(torch.cat(crops[2:]))["sequence"]
    torch.testing.assert_close(out.class_tokens, torch.cat([global_seq[:, 0], local_seq[:, 0]]))
    picked = global_seq[:, 1:][torch.cat(masks)]
    torch.testing.assert_close(out.patch_logits, model.head.patch_head(picked))
    unmasked = model.trunk(torch.cat(crops[:2]))["sequence"]
    assert (unmasked[:, 0] - global_seq[:, 0]).abs().max() > 1e-4  # the mask token changed them
    # the teacher: its trunk sees the crops whole, its head scores the same masked patches
    teacher = model(crops[:2], **criterion.teacher_masking())
    torch.testing.assert_close(teacher.class_tokens, unmasked[:, 0])
    torch.testing.assert_close(teacher.patch_logits, model.head.patch_head(unmasked[:, 1:][torch.cat(masks)]))
    assert model(crops[:2]).patch_logits is None  # without masks no patch is scored


def test_the_loss_is_dino_plus_koleo_plus_ibot_on_sinkhorn_knopp_targets():
    cfg = _cfg()
    torch.manual_seed(0)
    model, criterion, crops = build_model(cfg.MODEL), build_method(cfg), _crops(1)
    masking = criterion.masking(crops)
    masks = torch.cat(masking["mask"])
    with torch.no_grad():
        teacher = build_model(cfg.MODEL)(crops[:2], **criterion.teacher_masking())
    out = model(crops, **masking)
    loss = criterion(out, 4, teacher)
    temp = criterion.teacher_temp()
    dino_targets = sinkhorn_knopp_teacher(teacher.class_logits, temp).chunk(2)
    want = dino_cross_entropy(out.class_logits.chunk(4), dino_targets, 0.1)
    want = want + 0.1 * sum(koleo_loss(c) for c in out.class_tokens.chunk(4)[:2])
    want = want + ibot_cross_entropy(
        out.patch_logits, sinkhorn_knopp_teacher(teacher.patch_logits, temp), masks, 0.1
    )
    torch.testing.assert_close(loss, want, rtol=1e-6, atol=0)
    assert torch.equal(criterion.loss.center, torch.zeros_like(criterion.loss.center))  # no centre with SK
    with pytest.raises(ValueError, match="call both before the forwards"):
        criterion(out, 4, teacher)


@pytest.mark.parametrize("use_bn", [False, True])
def test_the_teachers_head_scores_the_masked_patches_only(use_bn):
    """dinov2's ssl_meta_arch.py selects the masked patch tokens before the teacher's head. Without
    BatchNorm in the head the loss equals scoring every patch and keeping the masked ones after
    (this head before); with it, the head's BatchNorm sees the masked patches only."""
    cfg = _cfg(f"config.MODEL.HEAD.USE_BN={use_bn}", "config.LOSS.dino_loss.centering=centre")
    torch.manual_seed(0)
    model, teacher_model, crops = build_model(cfg.MODEL), build_model(cfg.MODEL), _crops(5)
    torch.manual_seed(1)
    criterion = build_method(cfg)
    torch.manual_seed(1)
    before = build_method(cfg)  # the same mask generator
    masking, masks = criterion.masking(crops), torch.cat(before.masking(crops)["mask"])
    with torch.no_grad():
        teacher = teacher_model(crops[:2], **criterion.teacher_masking())
        every = teacher_model(crops[:2], head_mask=[torch.ones(4, 16, dtype=torch.bool)] * 2)
        tokens = teacher_model.trunk(torch.cat(crops[:2]))["sequence"][:, 1:][masks]
    torch.testing.assert_close(
        teacher.patch_logits, teacher_model.head.patch_head(tokens), rtol=1e-6, atol=1e-6
    )
    kept = every.patch_logits.view(8, 16, -1)[masks]
    out = model(crops, **masking)
    loss, loss_before = criterion(out, 4, teacher), before(out, 4, every._replace(patch_logits=kept))
    if use_bn:
        assert (teacher.patch_logits - kept).abs().max() > 1e-3
    else:
        torch.testing.assert_close(loss, loss_before, rtol=0, atol=1e-6)


def test_with_the_centres_both_move_and_dinos_head_scores_the_patches():
    cfg = _cfg("config.LOSS.dino_loss.centering=centre", "config.MODEL.HEAD.PATCH_OUT_DIM=0")
    torch.manual_seed(0)
    model, criterion, crops = build_model(cfg.MODEL), build_method(cfg), _crops(2)
    assert model.head.patch_head is None
    masking = criterion.masking(crops)
    with torch.no_grad():
        teacher = build_model(cfg.MODEL)(crops[:2], **criterion.teacher_masking())
    out = model(crops, **masking)
    assert out.patch_logits.shape[1] == 32
    criterion(out, 4, teacher).backward()
    assert criterion.loss.center.abs().sum() > 0 and criterion.ibot.center.abs().sum() > 0
    assert model.trunk.mask_token.grad.abs().sum() > 0
    assert len([m for m in model.modules() if isinstance(m, DINOLastLayer)]) == 1


def test_koleo_alone_masks_nothing_and_scores_no_patch_of_the_student():
    cfg = _cfg("config.LOSS.dino_loss.ibot_weight=0.0", "config.MODEL.HEAD.PATCH_OUT_DIM=0")
    criterion, model, crops = build_method(cfg), build_model(cfg.MODEL), _crops()
    masking = criterion.masking(crops)
    assert masking == {} == criterion.teacher_masking() and "masks._extra_state" not in criterion.state_dict()
    assert model(crops, **masking).patch_logits is None


def test_plain_dino_is_untouched():
    cfg = load_config(["config=test/dino_tiny"])
    criterion = build_method(cfg)
    assert criterion.masking(_crops()) == {} and list(criterion.state_dict()) == ["loss.center"]


def test_masks_are_per_rank_and_come_back_with_the_criterion_state():
    torch.manual_seed(3)
    criterion, crops = build_method(_cfg()), _crops()
    state = criterion.state_dict()
    first = torch.cat(criterion.masking(crops)["mask"])
    second = torch.cat(criterion.masking(crops)["mask"])
    assert not torch.equal(first, second)
    criterion.load_state_dict(state)
    assert torch.equal(torch.cat(criterion.masking(crops)["mask"]), first)


def _masks_on_rank(rank, world):
    torch.manual_seed(3)  # every rank the run's seed, as start_run does
    return torch.cat(build_method(_cfg()).masking(_crops())["mask"])


def test_ranks_mask_their_images_independently():
    first, second = run_on_ranks(_masks_on_rank, 2)
    assert not torch.equal(first, second)


@pytest.mark.parametrize(
    "overrides,message",
    [
        (["config.MODEL.TRUNK.VIT.MASK_TOKEN=False"], "set MODEL.TRUNK.VIT.MASK_TOKEN=True"),
        (["config.MODEL.HEAD.SEQUENCE=False"], "set MODEL.HEAD.SEQUENCE=True"),
        (["config.MODEL.TRUNK.OUT_FEATURES=[avgpool]"], "MODEL.TRUNK.OUT_FEATURES=[sequence]"),
        (["config.LOSS.dino_loss.ibot_weight=0.0"], "PATCH_OUT_DIM > 0 is an iBOT head"),
    ],
)
def test_what_dinov2_cannot_train_is_one_line(overrides, message):
    with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("]", r"\]")):
        build_method(_cfg(*overrides))


def test_the_planner_traces_the_head_on_the_token_sequence():
    """With the criterion's iBOT masks (they select the patch tokens by value on the meta device)."""
    cfg = _cfg()
    crops = crops_of(cfg.DATA.TRAIN)
    total, _, _ = ModelShapes(cfg.MODEL, loss_cfg=cfg.LOSS).activations(crops, 4, None)
    plain = load_config(["config=test/dinov2_tiny", "config.MODEL.HEAD.SEQUENCE=False"]).MODEL
    plain.defrost()
    plain.HEAD.PATCH_OUT_DIM, plain.TRUNK.OUT_FEATURES = 0, ["avgpool"]
    assert total > ModelShapes(plain).activations(crops, 4, None)[0] > 0


def test_the_planner_counts_the_teachers_masked_patches_at_their_bound():
    """dinov2's collate ``upperbound``: 4 of 8 images masked, at most 0.2, 0.3, 0.4, 0.5 of 16."""
    bound = ibot_masked_bound(8, 16, (0.1, 0.5), 0.5)
    assert bound == 3 + 4 + 6 + 8
    g = torch.Generator().manual_seed(0)
    assert max(int(ibot_masks(8, (4, 4), (0.1, 0.5), 0.5, g).sum()) for _ in range(20)) <= bound
    # the teacher's class logits, class tokens and masked patches' logits (fp32)
    assert METHODS["dino_loss"].loss_memory(_cfg()) == (8 * 32 + 8 * 16 + bound * 24) * 4


def test_a_trunk_pretrained_with_a_mask_token_is_evaluated(tmp_path):
    model = build_model(_cfg().MODEL)
    torch.save(model.state_dict(), tmp_path / "weights.pt")
    weights = f"config.MODEL.WEIGHTS_INIT.PARAMS_FILE={tmp_path / 'weights.pt'}"
    cfg = load_config(["config=test/simclr_vit_tiny", "config.MODEL.HEAD.NAME=identity", weights])
    evaluated = build_model(cfg.MODEL)  # the benchmarks' trunk: no mask token
    load_weights(evaluated, cfg.MODEL.WEIGHTS_INIT)
    torch.testing.assert_close(evaluated.trunk.conv_proj.weight, model.trunk.conv_proj.weight)


# -- training on 2 ranks -------------------------------------------------------------------------
def _train_on_rank(rank, world, argv):
    train(load_config(argv))


def _run(run_dir, *overrides):
    return [
        "config=test/dinov2_tiny",
        f"config.CHECKPOINT.DIR={run_dir}",
        "config.LOG_FREQUENCY=1",
        "config.CHECKPOINT.CHECKPOINT_ITER_FREQUENCY=2",
        "config.CHECKPOINT.KEEP_LAST=10",
        *overrides,
    ]


def _losses(run_dir):
    return [json.loads(line)["loss"] for line in Path(run_dir, "metrics.jsonl").read_text().splitlines()]


SHARDED, DDP = (
    "config.MODEL.FSDP_CONFIG.AUTO_SETUP_FSDP=True",
    "config.MODEL.FSDP_CONFIG.AUTO_SETUP_FSDP=False",
)


@pytest.mark.parametrize(
    "variant",
    [
        [],  # Sinkhorn-Knopp, a separate iBOT head, KoLeo
        ["config.LOSS.dino_loss.centering=centre", "config.MODEL.HEAD.PATCH_OUT_DIM=0"],
    ],
)
def test_the_tiny_recipe_sharded_equals_ddp(variant, tmp_path):
    run_on_ranks(_train_on_rank, 2, _run(tmp_path / "sharded", SHARDED, *variant))
    run_on_ranks(_train_on_rank, 2, _run(tmp_path / "ddp", DDP, *variant))
    torch.testing.assert_close(
        _losses(tmp_path / "sharded")[:3], _losses(tmp_path / "ddp")[:3], rtol=1e-5, atol=0
    )


def test_resume_on_the_same_ranks_draws_the_same_masks(tmp_path):
    full, resumed = tmp_path / "full", tmp_path / "resumed"
    run_on_ranks(_train_on_rank, 2, _run(full, SHARDED))
    shutil.copytree(full / "checkpoint_2", resumed / "checkpoint_2")
    run_on_ranks(_train_on_rank, 2, _run(resumed, SHARDED))
    assert _losses(resumed) == _losses(full)[2:]


def _resumed_on(rank, world, argv):
    cfg = load_config(argv)
    run = _build(cfg, torch.device("cpu"))
    iteration, _ = resume(cfg.CHECKPOINT.DIR, run)
    teacher, student = run.teacher.model.state_dict(), run.model.state_dict()  # collective
    dist.barrier()
    return iteration, teacher, student, run.criterion.ibot.center.clone()


def test_two_ranks_checkpoint_resumes_on_three(tmp_path):
    cfg = ["config.LOSS.dino_loss.centering=centre"]  # a centre to carry over
    run_on_ranks(_train_on_rank, 2, _run(tmp_path / "two", SHARDED, *cfg))
    checkpoint = tmp_path / "two" / "checkpoint_4"
    saved = consolidated_state_dict(str(checkpoint))
    saved_centre = torch.load(checkpoint / "rank0.pt", weights_only=True)["extra"]["loss"]["ibot.center"]
    assert saved_centre.abs().sum() > 0
    shutil.copytree(checkpoint, tmp_path / "three" / "checkpoint_4")
    for iteration, teacher, student, centre in run_on_ranks(
        _resumed_on, 3, _run(tmp_path / "three", SHARDED, *cfg)
    ):
        assert iteration > 0
        for key, value in teacher.items():
            torch.testing.assert_close(value, saved[f"teacher.{key}"], rtol=0, atol=0, msg=key)
        for key, value in student.items():
            torch.testing.assert_close(value, saved[key], rtol=0, atol=0, msg=key)
        torch.testing.assert_close(centre, saved_centre, rtol=0, atol=0)
