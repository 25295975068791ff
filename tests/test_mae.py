"""MAE (``vistrain/methods/mae.py``): the loss against its formula written out, the decoder's
placement of the kept tokens, the criterion's masks (per rank, resumable), and the tiny recipe
sharded against DDP and resumed on the same and on another number of ranks."""

import json
import shutil
from pathlib import Path

import pytest
import torch

from vistrain.checkpoint import consolidated_state_dict
from vistrain.config import ConfigError
from vistrain.distributed.testing import run_on_ranks
from vistrain.losses.mae import mae_loss
from vistrain.methods import build_method, build_model, load_config
from vistrain.methods.mae import MAECriterion
from vistrain.models.masking import random_keep
from vistrain.training.resume import resume
from vistrain.training.trainer import _build, train


def test_mae_loss_is_the_mean_squared_error_on_masked_patches():
    g = torch.Generator().manual_seed(0)
    predicted, target = torch.randn(3, 9, 12, generator=g), torch.randn(3, 9, 12, generator=g)
    _, masked = random_keep(3, 9, 0.6, g)
    for norm in (False, True):
        total, count = 0.0, 0
        for n in range(3):
            for patch in masked[n].tolist():
                t = target[n, patch]
                if norm:
                    mean = sum(t.tolist()) / 12
                    var = sum((v - mean) ** 2 for v in t.tolist()) / 11
                    t = (t - mean) / (var + 1e-6) ** 0.5
                total += sum(((predicted[n, patch] - t) ** 2).tolist()) / 12
                count += 1
        assert abs(mae_loss(predicted, target, masked, norm).item() - total / count) < 1e-5


def _cfg(*overrides):
    return load_config(["config=test/mae_tiny", *overrides])


def test_the_decoder_puts_each_kept_token_at_its_patch():
    model = build_model(_cfg().MODEL)
    decoder = model.head
    encoded = torch.randn(2, 1 + 4, 16)
    keep = torch.stack([torch.randperm(16)[:4] for _ in range(2)])
    out = decoder(encoded, keep)
    assert out.shape == (2, 16, 4 * 4 * 3)
    order = torch.randperm(4)  # the same tokens listed in another order: the same reconstruction
    shuffled = torch.cat([encoded[:, :1], encoded[:, 1:][:, order]], 1)
    torch.testing.assert_close(decoder(shuffled, keep[:, order]), out)
    moved = keep.clone()  # the first kept token moved to a masked place: another reconstruction
    for n in range(2):
        moved[n, 0] = next(p for p in range(16) if p not in keep[n].tolist())
    assert (decoder(encoded, moved) - out).abs().max() > 1e-4


def test_masks_are_per_rank_and_come_back_with_the_criterion_state():
    cfg = _cfg()
    torch.manual_seed(3)
    criterion = build_method(cfg)
    images = torch.randn(5, 3, 16, 16)
    keep = criterion.masking([images])["keep"]
    assert keep.shape == (5, 4) and len(set(keep[0].tolist())) == 4
    state = criterion.state_dict()
    later = criterion.masking([images])["keep"]
    assert not torch.equal(later, keep)
    criterion.load_state_dict(state)
    assert torch.equal(criterion.masking([images])["keep"], later)
    predicted = torch.zeros(5, 16, 48)
    loss = criterion(predicted, 1)
    _, masked = criterion._pending or (None, None)
    assert masked is None and loss > 0
    with pytest.raises(ValueError, match="call it before the model"):
        criterion(predicted, 1)
    with pytest.raises(ValueError, match="one crop per image"):
        criterion.masking([images, images])


def _masks_on_rank(rank, world):
    torch.manual_seed(3)  # every rank the run's seed, as start_run does
    return MAECriterion(_cfg().LOSS.mae_loss, _cfg().MODEL).masking([torch.zeros(6, 3, 16, 16)])["keep"]


def test_ranks_mask_their_images_independently():
    first, second = run_on_ranks(_masks_on_rank, 2)
    assert not torch.equal(first, second)


@pytest.mark.parametrize(
    "overrides,message",
    [
        (
            ["config.MODEL.TRUNK.NAME=regnet"],
            "LOSS.NAME=mae_loss masks a ViT's patches: MODEL.TRUNK.NAME=regnet has no patch tokens to mask",
        ),
        (
            ["config.MODEL.TRUNK.NAME=timm", "config.MODEL.TRUNK.TIMM.NAME=test_convnext"],
            "LOSS.NAME=mae_loss masks a ViT's patches: timm ConvNeXt is no VisionTransformer",
        ),
        (["config.MODEL.TRUNK.OUT_FEATURES=[avgpool]"], "add sequence to MODEL.TRUNK.OUT_FEATURES"),
        (["config.DATA.TRAIN.TRANSFORMS.NUM_CROPS=[2]"], "takes exactly 1 crops per image"),
        (["config.MODEL.HEAD.DIMS=[16,6]"], "decoder width a multiple of 4 and of DECODER_HEADS"),
    ],
)
def test_what_mae_cannot_train_is_one_line(overrides, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(")):
        cfg = _cfg(*overrides)
        build_method(cfg)
        build_model(cfg.MODEL)


def _train_on_rank(rank, world, argv):
    train(load_config(argv))


def _run(run_dir, *overrides):
    return [
        "config=test/mae_tiny",
        f"config.CHECKPOINT.DIR={run_dir}",
        "config.LOG_FREQUENCY=1",
        "config.CHECKPOINT.CHECKPOINT_ITER_FREQUENCY=2",
        "config.CHECKPOINT.KEEP_LAST=10",
        *overrides,
    ]


def _losses(run_dir):
    return [json.loads(line)["loss"] for line in Path(run_dir, "metrics.jsonl").read_text().splitlines()]


def test_the_tiny_recipe_sharded_equals_ddp_and_resumes_with_its_masks(tmp_path):
    sharded, ddp, resumed = tmp_path / "sharded", tmp_path / "ddp", tmp_path / "resumed"
    run_on_ranks(_train_on_rank, 2, _run(sharded, "config.MODEL.FSDP_CONFIG.AUTO_SETUP_FSDP=True"))
    run_on_ranks(_train_on_rank, 2, _run(ddp, "config.MODEL.FSDP_CONFIG.AUTO_SETUP_FSDP=False"))
    torch.testing.assert_close(_losses(sharded)[:3], _losses(ddp)[:3], rtol=1e-5, atol=0)
    shutil.copytree(sharded / "checkpoint_2", resumed / "checkpoint_2")
    run_on_ranks(_train_on_rank, 2, _run(resumed, "config.MODEL.FSDP_CONFIG.AUTO_SETUP_FSDP=True"))
    assert _losses(resumed) == _losses(sharded)[2:]  # the same masks after the resume


def _resumed_on(rank, world, argv):
    cfg = load_config(argv)
    run = _build(cfg, torch.device("cpu"))
    iteration, _ = resume(cfg.CHECKPOINT.DIR, run)
    return iteration, run.model.state_dict()


def test_two_ranks_checkpoint_resumes_on_three(tmp_path):
    run_on_ranks(_train_on_rank, 2, _run(tmp_path / "two", "config.MODEL.FSDP_CONFIG.AUTO_SETUP_FSDP=True"))
    checkpoint = tmp_path / "two" / "checkpoint_4"
    saved = consolidated_state_dict(str(checkpoint))
    shutil.copytree(checkpoint, tmp_path / "three" / "checkpoint_4")
    three = _run(tmp_path / "three", "config.MODEL.FSDP_CONFIG.AUTO_SETUP_FSDP=True")
    for iteration, state in run_on_ranks(_resumed_on, 3, three):
        assert iteration > 0
        for key, value in state.items():
            torch.testing.assert_close(value, saved[key], rtol=0, atol=0, msg=key)
