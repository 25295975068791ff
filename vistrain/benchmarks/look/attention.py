"""Where the trunk looks: ``attention.png``.

* A ViT (the built-in one, or a timm VisionTransformer): the self-attention of the class token to
  every patch in the last block, one map per head (DINO's figure, Caron et al. 2021, Fig. 1):
  ``softmax(q_cls . k_j / sqrt(d))`` over the sequence, read at the patches j and laid out on the
  patch grid. Without a class token, the attention each patch receives, averaged over the patches.
  The weights are recomputed from the last attention layer's input, caught by a forward hook: an
  ``nn.MultiheadAttention`` (torchvision's blocks) is asked for them; a timm ``Attention`` (``qkv``,
  ``num_heads``, optional ``q_norm`` / ``k_norm``) is recomputed from its own projections.
* A CNN: the L2 norm over channels of its last stage's map at each location, the closest it has
  (where its strongest activations are).

Each row: the image, then its maps upsampled to the image and drawn over it (matplotlib).
"""

from typing import List, Tuple

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from vistrain.benchmarks.look.sample import Sample
from vistrain.config import InputError
from vistrain.models.trunks import TokenLayout
from vistrain.runtime import pictures


def attention_layer(model: nn.Module) -> nn.Module:
    """The last self-attention layer of ``model`` (in module order): an ``nn.MultiheadAttention``
    or a module with a ``qkv`` Linear and ``num_heads``."""
    found = None
    for module in model.modules():
        if isinstance(module, nn.MultiheadAttention) or (
            isinstance(getattr(module, "qkv", None), nn.Linear) and hasattr(module, "num_heads")
        ):
            found = module
    if found is None:
        raise InputError("the trunk has no self-attention layer to draw: LOOK attention reads a ViT's")
    return found


@torch.no_grad()
def attention_weights(layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """(N, heads, S, S) softmax attention of ``layer`` on its input ``x`` (N, S, D)."""
    if isinstance(layer, nn.MultiheadAttention):
        seq = x if layer.batch_first else x.transpose(0, 1)
        _, weights = layer(seq, seq, seq, need_weights=True, average_attn_weights=False)
        return weights.float()
    n, s, _ = x.shape
    heads = layer.num_heads
    qkv = layer.qkv(x).reshape(n, s, 3, heads, -1).permute(2, 0, 3, 1, 4)  # (3, N, heads, S, d)
    q, k = qkv[0], qkv[1]
    q = layer.q_norm(q) if hasattr(layer, "q_norm") else q
    k = layer.k_norm(k) if hasattr(layer, "k_norm") else k
    scale = getattr(layer, "scale", q.shape[-1] ** -0.5)
    return ((q.float() * scale) @ k.float().transpose(-2, -1)).softmax(dim=-1)


@torch.no_grad()
def class_token_maps(model: nn.Module, images: torch.Tensor, layout: TokenLayout) -> torch.Tensor:
    """(N, heads, h, w): the class token's attention to each patch in the last block (see the
    module docstring); ``images`` (N, 3, H, W), h = H / patch, w = W / patch."""
    layer = attention_layer(model)
    caught = {}

    def catch(module, args, kwargs):
        caught["x"] = args[0] if args else kwargs.get("query", kwargs.get("x"))

    handle = layer.register_forward_pre_hook(catch, with_kwargs=True)
    try:
        model(images)
    finally:
        handle.remove()
    x = caught["x"]
    if isinstance(layer, nn.MultiheadAttention) and not layer.batch_first:
        x = x.transpose(0, 1)
    weights = attention_weights(layer, x)  # (N, heads, S, S)
    h, w = images.shape[2] // layout.patch_size, images.shape[3] // layout.patch_size
    prefix = weights.shape[-1] - h * w  # class token, registers
    rows = weights[:, :, 0, prefix:] if layout.class_token else weights[:, :, prefix:, prefix:].mean(dim=2)
    return rows.reshape(images.shape[0], -1, h, w)


@torch.no_grad()
def norm_maps(model: nn.Module, images: torch.Tensor, names: List[str]) -> List[torch.Tensor]:
    """For each trunk map of ``names`` (N, C, h, w): its L2 norm over channels, (N, h, w)."""
    out = model(images)
    return [out[name].float().norm(dim=1) for name in names]


def draw(model: nn.Module, sample: Sample, layout, spatial: List[str], cfg, device) -> Tuple[object, str]:
    """(the picture, a one-line description) of ``LOOK.ATTENTION_IMAGES`` images of ``sample``:
    class-token attention per head for a ViT (``layout`` a TokenLayout), else the feature norm of
    each map of ``spatial`` (a CNN's stem and stages, shallow to deep)."""
    rows = sample.examples(cfg.LOOK.ATTENTION_IMAGES)
    images = torch.stack([sample.dataset.views((int(sample.indices[r]), 0))[0] for r in rows]).to(device)
    if isinstance(layout, TokenLayout):
        heads = class_token_maps(model, images, layout)
        maps = [heads[:, h] for h in range(heads.shape[1])]
        what = "class-token attention of the last block" if layout.class_token else "mean attention received"
        titles = [f"head {h + 1}" for h in range(len(maps))]
    else:
        if not spatial:
            raise InputError("the trunk has no feature map to draw (MODEL.TRUNK offers vectors only)")
        maps, what = norm_maps(model, images, spatial), "feature norm per location"
        titles = [f"{name} ({m.shape[-1]}x{m.shape[-2]})" for name, m in zip(spatial, maps)]
    # each patch or location one block of pixels, as the trunk sees it
    up = [F.interpolate(m[:, None].cpu(), size=images.shape[-2:], mode="nearest")[:, 0].numpy() for m in maps]
    pixels = [sample.pixels(r) for r in rows]
    captions = [sample.label(r) or f"#{int(sample.indices[r])}" for r in rows]
    return figure(pixels, np.stack(up, axis=1), titles, captions, what), f"{what}, {len(rows)} images"


def figure(pixels, maps: np.ndarray, titles: List[str], captions: List[str], what: str):
    """Rows: an image, then each of its maps (N, M, H, W) over it (colour map "inferno", each map
    scaled to its own range)."""
    count, heads = maps.shape[0], maps.shape[1]
    fig = pictures.figure(1.5 * (heads + 1), 1.5 * count + 0.5)
    fig.suptitle(what)
    for i in range(count):
        axes = fig.add_subplot(count, heads + 1, i * (heads + 1) + 1)
        axes.imshow(pixels[i])
        axes.set_ylabel(captions[i])
        for h in range(heads):
            cell = fig.add_subplot(count, heads + 1, i * (heads + 1) + h + 2)
            cell.imshow(pixels[i].mean(axis=2), cmap="gray")
            cell.imshow(maps[i, h], cmap="inferno", alpha=0.65)
            if i == 0:
                cell.set_title(titles[h], fontsize="small")
            cell.set_xticks([])
            cell.set_yticks([])
        axes.set_xticks([])
        axes.set_yticks([])
    return pictures.figure_image(fig)
