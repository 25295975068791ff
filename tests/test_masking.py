"""Token masks, patches and sin-cos position embeddings (``vistrain/models/masking.py``), and the
ViT trunk's masked forward, against lightly 1.6.0 (``random_token_mask``, ``patchify``, the MAE
sin-cos table, ``MaskedVisionTransformerTorchvision.encode``) on the same tensors."""

import pytest
import torch
from lightly.models import utils as lightly_utils
from lightly.models.modules import MaskedVisionTransformerTorchvision
from torchvision.models import VisionTransformer

from vistrain.fsdp import build_on_meta, materialize
from vistrain.models.masking import (
    block_mask,
    patchify,
    random_keep,
    random_mask,
    sincos_position_embedding,
    unpatchify,
)
from vistrain.models.trunks.vit import ViTTrunk, to_torchvision_state_dict

DEPTH, WIDTH, HEADS, MLP, PATCH, IMAGE = 2, 32, 4, 64, 4, 20


@pytest.mark.parametrize("patches,ratio", [(25, 0.75), (5, 0.5), (49, 0.6), (16, 0.0), (7, 0.9)])
def test_random_keep_counts_as_lightly_and_partitions_the_patches(patches, ratio):
    keep, masked = random_keep(6, patches, ratio, torch.Generator().manual_seed(3))
    # lightly's count for a sequence of the patches and a class token it never masks (where it
    # would keep the class token alone, one patch stays: an encoder needs something to encode)
    lightly_keep, _ = lightly_utils.random_token_mask((6, patches + 1), mask_ratio=ratio)
    assert keep.shape == (6, max(1, lightly_keep.shape[1] - 1))
    assert masked.shape == (6, patches - keep.shape[1])
    everything = torch.cat([keep, masked], 1).sort(1).values
    assert torch.equal(everything, torch.arange(patches).expand(6, -1))
    again, _ = random_keep(6, patches, ratio, torch.Generator().manual_seed(3))
    assert torch.equal(again, keep)


def test_random_keep_keeps_every_patch_equally_often():
    g = torch.Generator().manual_seed(0)
    keep, _ = random_keep(20000, 8, 0.75, g)
    share = torch.bincount(keep.flatten(), minlength=8).float() / 20000
    assert (share - 0.25).abs().max() < 5 * (0.25 * 0.75 / 20000) ** 0.5


def test_random_mask_marks_the_masked_count_and_refuses_a_full_mask():
    mask = random_mask(4, 49, 0.75, torch.Generator().manual_seed(1))
    assert mask.dtype == torch.bool and mask.sum(1).tolist() == [49 - 12] * 4
    with pytest.raises(ValueError, match="mask_ratio must be in"):
        random_keep(2, 9, 1.0)


@pytest.mark.parametrize("count", [0, 1, 10, 24, 49])
def test_block_mask_masks_exactly_the_count_in_rectangles(count):
    g = torch.Generator().manual_seed(count)
    mask = block_mask((7, 7), count, g)
    assert mask.shape == (7, 7) and int(mask.sum()) == count
    assert torch.equal(mask, block_mask((7, 7), count, torch.Generator().manual_seed(count)))
    if count >= 10:  # blocks, not scattered patches: most masked patches have a masked neighbour
        padded = torch.nn.functional.pad(mask.float()[None, None], (1, 1, 1, 1))
        neighbours = torch.nn.functional.conv2d(
            padded, torch.tensor([[[[0, 1, 0], [1, 0, 1], [0, 1, 0]]]]).float()
        )
        assert (neighbours[0, 0][mask] > 0).float().mean() > 0.8
    with pytest.raises(ValueError, match="num_masked must be in"):
        block_mask((3, 3), 10)


def test_patchify_equals_lightly_and_unpatchify_inverts_it():
    images = torch.randn(3, 3, 12, 12)
    assert torch.equal(patchify(images, 4), lightly_utils.patchify(images, 4))
    assert torch.equal(unpatchify(patchify(images, 4), 4, (3, 3)), images)
    wide = torch.randn(2, 3, 8, 12)
    assert torch.equal(unpatchify(patchify(wide, 4), 4, (2, 3)), wide)


@pytest.mark.parametrize("width,grid", [(32, 5), (64, 7)])
def test_sincos_table_equals_maes(width, grid):
    reference = lightly_utils.get_2d_sine_cosine_positional_embedding(width, grid, cls_token=False)
    ours = sincos_position_embedding((grid, grid), width)
    assert (ours - torch.from_numpy(reference).float()).abs().max() < 1e-6


def _trunks(position_embedding="learned"):
    """Our trunk and lightly's masked ViT on a torchvision ViT holding the same weights."""
    torch.manual_seed(0)
    ours = ViTTrunk(
        DEPTH, WIDTH, HEADS, MLP, PATCH, IMAGE, True, ["sequence", "cls"], True, position_embedding
    )
    torch.nn.init.normal_(ours.mask_token)
    vit = VisionTransformer(IMAGE, PATCH, DEPTH, HEADS, WIDTH, MLP)
    lightly = MaskedVisionTransformerTorchvision(vit, weight_initialization="skip")
    vit.load_state_dict(to_torchvision_state_dict(ours.state_dict()), strict=False)
    lightly.mask_token = ours.mask_token
    return ours, lightly


@pytest.mark.parametrize("position_embedding", ["learned", "sincos"])
def test_a_kept_subset_and_a_mask_token_equal_lightlys_masked_vit(position_embedding):
    ours, lightly = _trunks(position_embedding)
    images = torch.randn(3, 3, IMAGE, IMAGE)
    keep, masked = random_keep(3, 25, 0.75)
    with_class = torch.cat([torch.zeros(3, 1, dtype=torch.long), keep + 1], 1)
    expected = lightly.encode(images, idx_keep=with_class)
    assert (ours(images, keep=keep)["sequence"] - expected).abs().max() < 1e-5
    mask = random_mask(3, 25, 0.4)
    expected = lightly.encode(images, mask=torch.cat([torch.zeros(3, 1, dtype=torch.bool), mask], 1))
    assert (ours(images, mask=mask)["sequence"] - expected).abs().max() < 1e-5
    unmasked = ours(images)["sequence"]
    assert torch.equal(ours(images, mask=torch.zeros_like(mask))["sequence"], unmasked)
    assert (ours(images, mask=mask)["sequence"] - unmasked).abs().max() > 1e-2


def test_kept_patches_in_any_order_are_the_unmasked_sequence_in_that_order():
    ours, _ = _trunks()
    images = torch.randn(2, 3, IMAGE, IMAGE)
    order = torch.stack([torch.randperm(25) for _ in range(2)])
    full = ours(images)["sequence"]
    permuted = ours(images, keep=order)["sequence"]
    expected = torch.cat([full[:, :1], full[:, 1:].gather(1, order[..., None].expand(-1, -1, WIDTH))], 1)
    assert (permuted - expected).abs().max() < 1e-5


def test_trunk_options_build_on_meta_and_refuse_what_does_not_fit():
    build = lambda: ViTTrunk(DEPTH, WIDTH, HEADS, MLP, PATCH, IMAGE, True, ["tokens"], True, "sincos", True)
    torch.manual_seed(1)
    plain = build()
    torch.manual_seed(1)
    meta = build_on_meta(build)
    for (name, a), (_, b) in zip(
        [*plain.named_parameters(), *plain.named_buffers()], [*meta.named_parameters(), *meta.named_buffers()]
    ):
        assert torch.equal(a, materialize(b) if b.is_meta else b), name
    assert not plain.conv_proj.weight.requires_grad and "encoder.pos_embedding" in dict(plain.named_buffers())
    with pytest.raises(ValueError, match='"tokens" map needs every patch'):
        plain(torch.randn(1, 3, IMAGE, IMAGE), keep=torch.arange(4)[None])
    no_token = ViTTrunk(DEPTH, WIDTH, HEADS, MLP, PATCH, IMAGE, True, ["cls"])
    with pytest.raises(ValueError, match="MODEL.TRUNK.VIT.MASK_TOKEN=True"):
        no_token(torch.randn(1, 3, IMAGE, IMAGE), mask=torch.zeros(1, 25, dtype=torch.bool))
