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

from vistrain.losses.ijepa import ijepa_loss, multiblock_masks
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


# --------------------------------------------------------------------------------------------
# I-JEPA


class AuthorsMaskCollator:
    """The authors' ``MaskCollator`` (masks only), their per-step seeded generator ``g`` and the
    global RNG of the block positions replaced by the two generators handed in."""

    def __init__(self, grid, pred_scale, aspect, enc_scale, npred, min_keep, positions):
        self.height = self.width = grid
        self.pred_mask_scale, self.aspect_ratio, self.enc_mask_scale = pred_scale, aspect, enc_scale
        self.nenc, self.npred, self.min_keep, self.positions = 1, npred, min_keep, positions

    def _sample_block_size(self, generator, scale, aspect_ratio_scale):
        _rand = torch.rand(1, generator=generator).item()
        min_s, max_s = scale
        mask_scale = min_s + _rand * (max_s - min_s)
        max_keep = int(self.height * self.width * mask_scale)
        min_ar, max_ar = aspect_ratio_scale
        aspect_ratio = min_ar + _rand * (max_ar - min_ar)
        h = int(round(math.sqrt(max_keep * aspect_ratio)))
        w = int(round(math.sqrt(max_keep / aspect_ratio)))
        while h >= self.height:
            h -= 1
        while w >= self.width:
            w -= 1
        return (h, w)

    def _sample_block_mask(self, b_size, acceptable_regions=None):
        h, w = b_size

        def constrain_mask(mask, tries=0):
            N = max(int(len(acceptable_regions) - tries), 0)
            for k in range(N):
                mask *= acceptable_regions[k]

        tries = 0
        timeout = og_timeout = 20
        valid_mask = False
        while not valid_mask:
            top = torch.randint(0, self.height - h, (1,), generator=self.positions)
            left = torch.randint(0, self.width - w, (1,), generator=self.positions)
            mask = torch.zeros((self.height, self.width), dtype=torch.int32)
            mask[top : top + h, left : left + w] = 1
            if acceptable_regions is not None:
                constrain_mask(mask, tries)
            mask = torch.nonzero(mask.flatten())
            valid_mask = len(mask) > self.min_keep
            if not valid_mask:
                timeout -= 1
                if timeout == 0:
                    tries += 1
                    timeout = og_timeout
        mask = mask.squeeze()
        mask_complement = torch.ones((self.height, self.width), dtype=torch.int32)
        mask_complement[top : top + h, left : left + w] = 0
        return mask, mask_complement

    def __call__(self, B, g):
        p_size = self._sample_block_size(
            generator=g, scale=self.pred_mask_scale, aspect_ratio_scale=self.aspect_ratio
        )
        e_size = self._sample_block_size(
            generator=g, scale=self.enc_mask_scale, aspect_ratio_scale=(1.0, 1.0)
        )
        collated_masks_pred, collated_masks_enc = [], []
        min_keep_pred = min_keep_enc = self.height * self.width
        for _ in range(B):
            masks_p, masks_C = [], []
            for _ in range(self.npred):
                mask, mask_C = self._sample_block_mask(p_size)
                masks_p.append(mask)
                masks_C.append(mask_C)
                min_keep_pred = min(min_keep_pred, len(mask))
            collated_masks_pred.append(masks_p)
            masks_e = []
            for _ in range(self.nenc):
                mask, _ = self._sample_block_mask(e_size, acceptable_regions=masks_C)
                masks_e.append(mask)
                min_keep_enc = min(min_keep_enc, len(mask))
            collated_masks_enc.append(masks_e)
        collated_masks_pred = [[cm[:min_keep_pred] for cm in cm_list] for cm_list in collated_masks_pred]
        collated_masks_enc = [[cm[:min_keep_enc] for cm in cm_list] for cm_list in collated_masks_enc]
        default_collate = torch.utils.data.default_collate
        return default_collate(collated_masks_enc), default_collate(collated_masks_pred), p_size


@pytest.mark.parametrize("grid, min_keep", [(16, 10), (7, 4), (14, 4)])
def test_ijepa_blocks_are_the_authors_on_the_same_draws(grid, min_keep):
    """The same context and target indices as the authors' collator for three steps; each target
    block a full h x w rectangle of the step's size, the context more than min_keep patches, in
    raster order, outside every target block (on 16x16, where no constraint is ever dropped)."""
    blocks = dict(target_scale=(0.15, 0.2), target_aspect=(0.75, 1.5), context_scale=(0.85, 1.0))
    ours_positions, theirs_positions = gen(11), gen(11)
    authors = AuthorsMaskCollator(grid, (0.15, 0.2), (0.75, 1.5), (0.85, 1.0), 4, min_keep, theirs_positions)
    for step in range(3):
        context, targets = multiblock_masks(
            6, (grid, grid), gen(step), ours_positions, 4, min_keep=min_keep, **blocks
        )
        [their_context], their_targets, (h, w) = authors(6, gen(step))
        assert torch.equal(context, their_context) and torch.equal(targets, torch.stack(their_targets))
        assert targets.shape == (4, 6, h * w) and context.shape[1] > min_keep
        for image_targets in targets.unbind(1):
            for block in image_targets:
                rows, cols = block // grid, block % grid
                assert rows.max() - rows.min() + 1 == h and cols.max() - cols.min() + 1 == w
        assert torch.equal(context.sort(1).values, context)
        if grid == 16:
            for n in range(6):
                assert not set(context[n].tolist()) & set(targets[:, n].flatten().tolist())


def authors_apply_masks(x, masks):
    return torch.cat([torch.gather(x, 1, m.unsqueeze(-1).repeat(1, 1, x.size(-1))) for m in masks], dim=0)


def test_ijepa_loss_is_the_authors_and_a_ranks_mean_the_global_one():
    features, predicted = torch.randn(6, 16, 8, generator=gen(1)), torch.randn(4 * 6, 3, 8, generator=gen(2))
    _, targets = multiblock_masks(6, (4, 4), gen(3), gen(4), 4, min_keep=0)
    predicted = predicted[:, : targets.shape[2]]
    h = authors_apply_masks(F.layer_norm(features, (8,)), list(targets))
    torch.testing.assert_close(
        ijepa_loss(predicted, features, targets), F.smooth_l1_loss(predicted, h), rtol=1e-6, atol=1e-6
    )
    rows = torch.arange(24).reshape(4, 6)
    halves = [
        ijepa_loss(predicted[rows[:, s].flatten()], features[s], targets[:, s])
        for s in (slice(0, 3), slice(3, 6))
    ]
    torch.testing.assert_close(sum(halves) / 2, ijepa_loss(predicted, features, targets), rtol=1e-6, atol=0)


def authors_predictor(p, x, masks_x, masks):
    """The authors' ``VisionTransformerPredictor.forward`` on our predictor's modules."""
    B = len(x)
    x = p.embed(x)
    x = x + authors_apply_masks(p.pos_embedding.repeat(B, 1, 1), masks_x)
    _, N_ctxt, D = x.shape
    pos_embs = authors_apply_masks(p.pos_embedding.repeat(B, 1, 1), masks)
    pred_tokens = p.mask_token.repeat(pos_embs.size(0), pos_embs.size(1), 1) + pos_embs
    x = torch.cat([x.repeat(len(masks), 1, 1), pred_tokens], dim=1)
    for blk in p.blocks:
        x = blk(x)
    return p.project(p.norm(x)[:, N_ctxt:])


@pytest.mark.parametrize("timm", [False, True])
def test_ijepa_predicts_each_target_block_from_the_context(timm):
    """The context encoder sees the context patches only; the predictor is the authors' on them;
    the target encoder's pass gives every patch token; the criterion's loss is I-JEPA's on them
    and trains the predictor and the encoder."""
    extra = [*TIMM_VIT[:3], "config.MODEL.HEAD.DIMS=[64,8]"] if timm else []
    cfg = load_config(["config=test/ijepa_tiny", *extra])
    assert method_problem(cfg) is None
    criterion, model = build_method(cfg), build_model(cfg.MODEL)
    assert criterion.teacher_momentum == 0.996
    images = torch.randn(4, 3, 16, 16, generator=gen(0))
    criterion.set_iteration(5, 0)
    masking = criterion.masking([images])
    context, targets = masking["keep"], masking["targets"]
    out = model([images], **masking)
    encoded = model.trunk(images, keep=context)["sequence"]
    assert encoded.shape[1] == model.head.num_prefix + context.shape[1]
    expected = authors_predictor(model.head, encoded[:, model.head.num_prefix :], [context], list(targets))
    torch.testing.assert_close(out, expected)
    with torch.no_grad():
        teacher = model([images])
    assert teacher.shape == (4, 16, model.head.project.out_features)
    loss = criterion(out, 1, teacher)
    torch.testing.assert_close(
        loss,
        F.smooth_l1_loss(out, authors_apply_masks(F.layer_norm(teacher, teacher.shape[-1:]), list(targets))),
    )
    loss.backward()
    assert model.head.mask_token.grad.abs().sum() > 0 and model.head.embed.weight.grad.abs().sum() > 0


def test_a_config_ijepa_cannot_train_is_one_line():
    line = method_problem(load_config(["config=test/ijepa_tiny", "config.LOSS.ijepa_loss.min_keep=2"]))
    assert "never holds more than min_keep=2: lower min_keep" in line
    line = method_problem(
        load_config(["config=test/ijepa_tiny", "config.MODEL.TRUNK.OUT_FEATURES=[avgpool]"])
    )
    assert "add sequence to MODEL.TRUNK.OUT_FEATURES" in line
