"""SimMIM and I-JEPA: their mask collators against the authors' algorithms on the same random
draws (with the mask statistics), their losses against the authors' formulas written out here on
the same tensors, a rank's mean against one process on the global batch, their heads, criteria and
one-line errors, on the built-in ViT and a timm ViT. Their demos train sharded = DDP and resume
from 2 ranks on 3 in tests/test_joint_embedding_methods.py.

References: microsoft/SimMIM (``MaskGenerator`` in ``data/data_simmim.py``; ``SimMIM.forward``
in ``models/simmim.py``) and facebookresearch/ijepa (``MaskCollator`` in
``src/masks/multiblock.py``; ``forward_target`` and ``loss_fn`` in ``src/train.py``), with numpy's
and torch's global RNG replaced by the generator both sides are handed.
"""

import math

import pytest
import torch
import torch.nn.functional as F

from vistrain.losses.simmim import simmim_loss, simmim_masks
from vistrain.methods import build_method, build_model, load_config
from vistrain.methods.configuration import method_problem

TIMM_VIT = [
    "config.MODEL.TRUNK.NAME=timm",
    "config.MODEL.TRUNK.TIMM.NAME=test_vit",
    "config.MODEL.TRUNK.TIMM.KWARGS={img_size: 16, patch_size: 4}",
    "config.MODEL.TRUNK.TIMM.MASK_TOKEN=True",
    "config.MODEL.HEAD.DIMS=[64]",
]


def gen(seed):
    return torch.Generator().manual_seed(seed)


# --------------------------------------------------------------------------------------------
# SimMIM


def authors_simmim_mask(input_size, mask_patch_size, model_patch_size, mask_ratio, generator):
    """The authors' ``MaskGenerator.__call__``, ``np.random.permutation`` -> ``torch.randperm``."""
    rand_size = input_size // mask_patch_size
    scale = mask_patch_size // model_patch_size
    token_count = rand_size**2
    mask_count = int(math.ceil(token_count * mask_ratio))
    mask_idx = torch.randperm(token_count, generator=generator)[:mask_count]
    mask = torch.zeros(token_count, dtype=torch.long)
    mask[mask_idx] = 1
    mask = mask.reshape(rand_size, rand_size)
    return mask.repeat_interleave(scale, 0).repeat_interleave(scale, 1)


@pytest.mark.parametrize(
    "input_size, mask_patch, model_patch, ratio",
    [(192, 32, 16, 0.6), (192, 32, 4, 0.6), (28, 4, 4, 0.6), (32, 8, 4, 0.3), (16, 8, 4, 0.75)],
)
def test_simmim_masks_are_the_authors_on_the_same_draws(input_size, mask_patch, model_patch, ratio):
    batch, grid = 5, input_size // model_patch
    ours = simmim_masks(batch, (grid, grid), mask_patch // model_patch, ratio, gen(3))
    theirs_gen = gen(3)
    theirs = [
        authors_simmim_mask(input_size, mask_patch, model_patch, ratio, theirs_gen) for _ in range(batch)
    ]
    assert torch.equal(ours, torch.stack(theirs).flatten(1).bool())
    units = (input_size // mask_patch) ** 2
    exact = math.ceil(units * ratio) * (mask_patch // model_patch) ** 2
    assert ours.sum(1).tolist() == [exact] * batch  # the same count in every image
    assert len({tuple(m.tolist()) for m in ours}) > 1  # images masked independently


def authors_simmim_loss(x, x_rec, mask, patch_size, in_chans=3):
    """``SimMIM.forward`` from the encoder's reconstruction on: mask (B, h, w)."""
    mask = mask.repeat_interleave(patch_size, 1).repeat_interleave(patch_size, 2).unsqueeze(1).contiguous()
    loss_recon = F.l1_loss(x, x_rec, reduction="none")
    return (loss_recon * mask).sum() / (mask.sum() + 1e-5) / in_chans


def test_simmim_loss_is_the_authors_and_a_ranks_mean_the_global_one():
    images, rec = torch.randn(6, 3, 16, 16, generator=gen(1)), torch.randn(6, 3, 16, 16, generator=gen(2))
    mask = simmim_masks(6, (4, 4), 2, 0.6, gen(3))
    ours = simmim_loss(images, rec, mask, 4)
    theirs = authors_simmim_loss(images, rec, mask.reshape(6, 4, 4).float(), 4)
    torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=1e-6)
    halves = [simmim_loss(images[s], rec[s], mask[s], 4) for s in (slice(0, 3), slice(3, 6))]
    torch.testing.assert_close(sum(halves) / 2, ours, rtol=1e-6, atol=0)  # DDP's mean over 2 ranks


@pytest.mark.parametrize("timm", [False, True])
def test_simmim_decodes_every_patch_and_learns_the_mask_token(timm):
    """The authors' decoder on the patch tokens (1x1 conv, pixel shuffle); the masked patches
    enter as the mask token, which gets a gradient; the loss is SimMIM's on the crop's pixels."""
    cfg = load_config(["config=test/simmim_tiny", *(TIMM_VIT if timm else [])])
    assert method_problem(cfg) is None
    criterion, model = build_method(cfg), build_model(cfg.MODEL)
    images = torch.randn(4, 3, 16, 16, generator=gen(0))
    masking = criterion.masking([images])
    assert masking["mask"].shape == (4, 16) and masking["mask"].sum(1).tolist() == [12] * 4
    out = model([images], **masking)
    loss = criterion(out, 1)
    sequence = model.trunk(images, **masking)["sequence"][:, model.head.num_prefix :]
    head = model.head.predict
    expected = F.pixel_shuffle(head(sequence.transpose(1, 2).reshape(4, -1, 4, 4)), 4)
    torch.testing.assert_close(out, expected)
    torch.testing.assert_close(
        loss, authors_simmim_loss(images, out, masking["mask"].reshape(4, 4, 4).float(), 4)
    )
    loss.backward()
    assert model.trunk.mask_token.grad.abs().sum() > 0


@pytest.mark.parametrize(
    "overrides, line",
    [
        (["config.MODEL.TRUNK.VIT.MASK_TOKEN=False"], "set MODEL.TRUNK.VIT.MASK_TOKEN=True"),
        (
            ["config.LOSS.simmim_loss.mask_patch_size=6"],
            "mask_patch_size=6 must be a multiple of the ViT's patch",
        ),
        (["config.MODEL.TRUNK.OUT_FEATURES=[cls]"], "add sequence to MODEL.TRUNK.OUT_FEATURES"),
    ],
)
def test_a_config_simmim_cannot_train_is_one_line(overrides, line):
    assert line in method_problem(load_config(["config=test/simmim_tiny", *overrides]))
