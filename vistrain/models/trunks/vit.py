"""Vision Transformer trunk (Dosovitskiy et al., 2021) from torchvision's encoder pieces.

An image (N, 3, H, W) is cut into P x P patches, each projected to a D-dim token by a stride-P
convolution; a learned class token is prepended (optional) and learned position embeddings are
added; then ``depth`` pre-norm encoder blocks ``x = x + MSA(LN(x)); x = x + MLP(LN(x))`` and a
final LayerNorm. We reuse torchvision's ``Encoder`` and ``EncoderBlock`` (and their
initialisation), so that

* parameter names are torchvision's (``conv_proj``, ``class_token``, ``encoder.pos_embedding``,
  ``encoder.layers.encoder_layer_<i>.*``, ``encoder.ln``): a trunk with a class token loads into
  ``torchvision.models.VisionTransformer`` of the same dims (``vit_b_16`` for base/16 at 224 px,
  see :func:`to_torchvision_state_dict`);
* a sharding wrap policy can select every ``EncoderBlock`` by class.

Position embeddings are made for ``IMAGE_SIZE`` and bicubically interpolated for other input
sides (DINO's local crops), as DINO's ``interpolate_pos_encoding`` does. LayerNorms compute in
float32 whatever their input's dtype (:class:`LayerNorm32`): under AMP or the engine's mixed
precision the statistics of a bf16/fp16 residual stream would otherwise lose digits. The blocks
(:class:`ViTBlock`) add stochastic depth (``DROP_PATH_RATE``) to torchvision's, for fine-tuning.
"""

import functools
import math
from collections import OrderedDict
from typing import Dict, List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
from torch import nn
from torchvision.models.vision_transformer import Encoder, EncoderBlock

from vistrain.config.errors import ConfigError
from vistrain.models.masking import sincos_position_embedding
from vistrain.models.trunks.family import (
    TokenLayout,
    TrunkFamily,
    check_out_features,
    torchvision_keys,
    torchvision_load_line,
    unknown_name,
)

# name -> (depth, width, heads, mlp_ratio): ViT-Ti/S/B (DeiT, DINO), ViT-L/H (Dosovitskiy et al.),
# ViT-g (dinov2's 1.1B giant: width 1536, 40 blocks, 24 heads; here with a plain GELU MLP)
VIT_SIZES = {
    "tiny": (12, 192, 3, 4.0),
    "small": (12, 384, 6, 4.0),
    "base": (12, 768, 12, 4.0),
    "large": (24, 1024, 16, 4.0),
    "huge": (32, 1280, 16, 4.0),
    "giant": (40, 1536, 24, 4.0),
}
LAYER_NORM_EPS = 1e-6  # torchvision's and DINO's
TORCHVISION_PREFIXES = ("conv_proj", "class_token", "encoder")
POOLED = ("cls", "avgpool", "tokens", "sequence")  # features read after the last block's final LayerNorm
POSITION_EMBEDDINGS = ("learned", "sincos")


class LayerNorm32(nn.LayerNorm):
    """``nn.LayerNorm`` computed in float32 whatever the input's dtype; output in the input's dtype.

    (..., D) -> (..., D): ``(x - mean) / sqrt(var + eps) * weight + bias`` over the last dim."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = None if self.weight is None else self.weight.float()
        bias = None if self.bias is None else self.bias.float()
        return F.layer_norm(x.float(), self.normalized_shape, weight, bias, self.eps).to(x.dtype)


def trunc_normal_(tensor: torch.Tensor, std: float) -> torch.Tensor:
    """Fill ``tensor`` from N(0, std^2) truncated to [-2 std, 2 std] by the inverse CDF:
    ``u ~ U(2 F(-2) - 1, 2 F(2) - 1)``, ``x = std * sqrt(2) * erfinv(u)`` (F: the standard normal
    CDF). Only whole-tensor in-place calls, so the sharded engine's per-unit initialisation can
    replay it (``nn.init.trunc_normal_`` skips meta tensors and rejection-samples)."""
    bound = math.erf(2 / math.sqrt(2))  # 2 F(2) - 1
    with torch.no_grad():
        tensor.uniform_(-bound, bound).erfinv_().mul_(std * math.sqrt(2)).clamp_(-2 * std, 2 * std)
    return tensor


def drop_path(x: torch.Tensor, rate: float, training: bool) -> torch.Tensor:
    """Stochastic depth of a residual branch ``x`` (N, ...): each sample's branch is zeroed with
    probability ``rate`` and the others scaled by 1 / (1 - rate), so its expectation is ``x``
    (Huang et al. 2016; DeiT's per-branch form). Identity in eval mode or at rate 0. The per-sample
    draws come from the device's global generator."""
    if not training or rate == 0.0:
        return x
    keep = 1.0 - rate
    mask = x.new_empty((x.shape[0],) + (1,) * (x.dim() - 1)).bernoulli_(keep)
    return x * mask.div_(keep)


class ViTBlock(EncoderBlock):
    """torchvision's pre-norm encoder block (same parameters, names and initialisation) with
    stochastic depth on both residual branches: ``x = x + dp(MSA(LN(x))); x = x + dp(MLP(LN(x)))``
    with ``dp`` = :func:`drop_path` at ``drop_path_rate``; at rate 0 it computes what
    ``EncoderBlock`` does, bit for bit. (N, S, D) -> (N, S, D)."""

    def __init__(self, *args, drop_path_rate: float = 0.0, **kwargs):
        super().__init__(*args, **kwargs)
        self.drop_path_rate = float(drop_path_rate)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        normed = self.ln_1(x)
        attended, _ = self.self_attention(normed, normed, normed, need_weights=False)
        x = x + drop_path(self.dropout(attended), self.drop_path_rate, self.training)
        return x + drop_path(self.mlp(self.ln_2(x)), self.drop_path_rate, self.training)


class ViTEncoder(Encoder):
    """torchvision's ``Encoder`` (position embeddings, blocks, final LayerNorm: the same names and
    the same draws from the generator) whose blocks are :class:`ViTBlock` s, block i's drop path
    rate ``drop_path_rate * i / (depth - 1)`` (DeiT's linear rule). Its ``forward`` is not used:
    :class:`ViTTrunk` runs the blocks itself."""

    def __init__(self, seq_length, depth, heads, width, mlp_dim, norm, drop_path_rate: float = 0.0):
        # the parent makes the position embeddings and the final norm (which draws nothing); the
        # blocks then draw what the parent's blocks would have, in the same order
        super().__init__(seq_length, 0, heads, width, mlp_dim, 0.0, 0.0, norm)
        rates = [drop_path_rate * i / max(depth - 1, 1) for i in range(depth)]
        self.layers = nn.Sequential(
            OrderedDict(
                (f"encoder_layer_{i}", ViTBlock(heads, width, mlp_dim, 0.0, 0.0, norm, drop_path_rate=rate))
                for i, rate in enumerate(rates)
            )
        )


def vit_dims(vit_cfg) -> Tuple[int, int, int, int]:
    """(depth, width, heads, mlp_dim) of ``cfg.MODEL.TRUNK.VIT`` (a size NAME or "custom"), with
    PATCH_SIZE and IMAGE_SIZE checked; ValueError (one line) for impossible values."""
    name = vit_cfg.NAME
    if name == "custom":
        depth, width, heads, ratio = vit_cfg.DEPTH, vit_cfg.WIDTH, vit_cfg.HEADS, vit_cfg.MLP_RATIO
    elif name in VIT_SIZES:
        depth, width, heads, ratio = VIT_SIZES[name]
    else:
        raise unknown_name("MODEL.TRUNK.VIT.NAME", name, ["custom", *VIT_SIZES])
    if depth <= 0 or width <= 0 or heads <= 0 or width % heads or ratio <= 0:
        raise ValueError(
            "invalid ViT dims: need DEPTH > 0, HEADS > 0, WIDTH a positive multiple of HEADS, "
            f"MLP_RATIO > 0 (got DEPTH={depth}, WIDTH={width}, HEADS={heads}, MLP_RATIO={ratio})"
        )
    patch, image = vit_cfg.PATCH_SIZE, vit_cfg.IMAGE_SIZE
    if patch <= 0 or image <= 0 or image % patch:
        raise ValueError(
            f"MODEL.TRUNK.VIT.IMAGE_SIZE ({image}) must be a positive multiple of PATCH_SIZE ({patch})"
        )
    return depth, width, heads, int(width * ratio)


def feature_names(trunk_cfg) -> List[str]:
    """The features a ViT of ``trunk_cfg`` offers: "cls" (with a class token), "avgpool",
    "tokens", block1..blockD. Pure arithmetic; ValueError for impossible dims."""
    return _names(vit_dims(trunk_cfg.VIT)[0], trunk_cfg.VIT.CLASS_TOKEN)


def _names(depth: int, class_token: bool) -> List[str]:
    pooled = POOLED if class_token else POOLED[1:]
    return [*pooled, *(f"block{i}" for i in range(1, depth + 1))]


class ViTTrunk(nn.Module):
    """ViT without classifier.

    ``forward(x)``: x (N, 3, H, W), H and W multiples of ``patch_size`` -> {name: feature} for each
    name in ``out_features``, all after the final LayerNorm (DINO's ``get_intermediate_layers``):

    * ``"cls"`` (N, D): the class token;
    * ``"avgpool"`` (N, D): the mean of the patch tokens;
    * ``"tokens"`` (N, D, H/P, W/P): the patch tokens as a map (pooled like a CNN stage by the
      benchmarks);
    * ``"sequence"`` (N, prefix + L, D): every token of the sequence, class token first (L: the
      patches, or the kept ones);
    * ``"block<i>"`` (N, D): block i's output (1-based), its class token (else its mean patch
      token); DINO's linear evaluation concatenates the last four (``block9+...+block12``).

    ``feature_dims`` maps every available feature name to D, ``vector_features`` names the (N, D)
    ones (the benchmarks pool only maps). Blocks after the last requested feature are skipped.

    Masked-image modelling (``models/masking.py`` draws the masks): ``forward(x, keep=...)`` with
    ``keep`` (N, K) patch indices runs the encoder on those patches only, each with its own
    position embedding (MAE); ``forward(x, mask=...)`` with a boolean (N, L) replaces the masked
    patch embeddings by the learned ``mask_token`` before the position embeddings are added
    (iBOT, DINOv2; ``mask_token=True``). ``position_embedding="sincos"``: fixed 2-D sin-cos
    embeddings (MAE, MoCo v3), a buffer under torchvision's name; ``frozen_patch_projection``:
    the random patch projection is never trained (MoCo v3's stabiliser for ViTs).
    """

    def __init__(
        self,
        depth: int,
        width: int,
        heads: int,
        mlp_dim: int,
        patch_size: int,
        image_size: int,
        class_token: bool,
        out_features: Sequence[str],
        mask_token: bool = False,
        position_embedding: str = "learned",
        frozen_patch_projection: bool = False,
        drop_path_rate: float = 0.0,
    ):
        super().__init__()
        self.patch_size, self.grid = patch_size, image_size // patch_size
        self.conv_proj = nn.Conv2d(3, width, kernel_size=patch_size, stride=patch_size)
        if class_token:
            self.class_token = nn.Parameter(torch.zeros(1, 1, width))
        else:
            self.register_parameter("class_token", None)
        self.num_prefix = int(class_token)
        norm = functools.partial(LayerNorm32, eps=LAYER_NORM_EPS)
        self.encoder = ViTEncoder(
            self.grid**2 + self.num_prefix, depth, heads, width, mlp_dim, norm, drop_path_rate
        )
        # torchvision's patchify init (its VisionTransformer.__init__)
        trunc_normal_(self.conv_proj.weight, std=math.sqrt(1 / (3 * patch_size * patch_size)))
        nn.init.zeros_(self.conv_proj.bias)
        self.conv_proj.requires_grad_(not frozen_patch_projection)
        if position_embedding == "sincos":
            self._fixed_position_embedding(width)
        elif position_embedding != "learned":
            raise ValueError(f"MODEL.TRUNK.VIT.POSITION_EMBEDDING must be one of {POSITION_EMBEDDINGS}")
        if mask_token:  # iBOT's and dinov2's: zeros
            self.mask_token = nn.Parameter(torch.zeros(1, 1, width))
        else:
            self.register_parameter("mask_token", None)

        names = _names(depth, class_token)
        self.feature_dims: Dict[str, int] = dict.fromkeys(names, width)
        # (N, D); "tokens" is a map, "sequence" the (N, L, D) tokens of masked-image modelling
        self.vector_features = [name for name in names if name not in ("tokens", "sequence")]
        self.out_features = check_out_features(out_features, names)
        wanted = set(self.out_features)
        self.blocks_needed = depth if wanted & set(POOLED) else max(int(n[5:]) for n in wanted)
        self.num_lr_layers = depth + 1  # layer-wise lr decay: see lr_layer_of

    def lr_layer_of(self, name: str) -> int:
        """Layer of parameter ``name`` (relative to the trunk) for layer-wise lr decay (BEiT, MAE):
        the patch embedding, class token, mask token and position embeddings 0, block i (0-based)
        i + 1, the final LayerNorm ``num_lr_layers`` (= depth + 1, the head's layer)."""
        if name.startswith("encoder.layers."):
            return int(name.split(".")[2].rsplit("_", 1)[1]) + 1
        if name.startswith("encoder.ln."):
            return self.num_lr_layers
        return 0

    def _fixed_position_embedding(self, width: int) -> None:
        """The learned position embeddings replaced by a buffer of the same name holding the
        sin-cos table (zeros for the class token). Built from a Python list: a factory call the
        sharded engine's meta-device build replays as it is."""
        table = sincos_position_embedding((self.grid, self.grid), width)
        rows = [[0.0] * width] * self.num_prefix + table.tolist()
        del self.encoder.pos_embedding
        self.encoder.register_buffer("pos_embedding", torch.tensor([rows]))

    def forward(
        self, x: torch.Tensor, keep: Optional[torch.Tensor] = None, mask: Optional[torch.Tensor] = None
    ) -> Dict[str, torch.Tensor]:
        """x (N, 3, H, W); ``keep`` (N, K) indices of the patches to encode, or ``mask`` (N, L)
        True where the patch embedding becomes the mask token."""
        x, grid = self._embed(x, keep, mask)
        n = x.shape[0]
        wanted, out = set(self.out_features), {}
        for i, block in enumerate(self.encoder.layers, start=1):
            if i > self.blocks_needed:
                break
            x = block(x)
            if f"block{i}" in wanted:
                out[f"block{i}"] = self._summary(self.encoder.ln(x))
        if wanted & set(POOLED):
            x = self.encoder.ln(x)
            patches = x[:, self.num_prefix :]
            if "cls" in wanted:
                out["cls"] = x[:, 0]
            if "avgpool" in wanted:
                out["avgpool"] = patches.mean(1)
            if "tokens" in wanted:
                if keep is not None:
                    raise ValueError('the "tokens" map needs every patch: read "sequence" with keep=')
                out["tokens"] = patches.transpose(1, 2).reshape(n, -1, *grid)
            if "sequence" in wanted:
                out["sequence"] = x
        return out

    def _embed(self, x: torch.Tensor, keep: Optional[torch.Tensor], mask: Optional[torch.Tensor]):
        """Patch embeddings (masked or only the kept ones), position embeddings, class token:
        (N, prefix + L', D) and the patch grid (h, w)."""
        n, _, h, w = x.shape
        if h % self.patch_size or w % self.patch_size:
            raise ConfigError(
                f"MODEL.TRUNK.VIT.PATCH_SIZE ({self.patch_size}) must divide the crop sides, got {h}x{w}: "
                "change PATCH_SIZE or the crop sizes"
            )
        x = self.conv_proj(x)  # (N, D, h, w) with h = H / P, w = W / P
        grid = tuple(x.shape[-2:])
        x = x.flatten(2).transpose(1, 2)  # (N, h * w, D)
        if mask is not None:
            if self.mask_token is None:
                raise ValueError("a mask needs the trunk's mask token: set MODEL.TRUNK.VIT.MASK_TOKEN=True")
            x = torch.where(
                mask.to(x.device).unsqueeze(-1), self.mask_token.to(x.dtype), x
            )  # meta: a CPU mask
        pos = self._position_embedding(grid)
        x = x + pos[:, self.num_prefix :]
        if keep is not None:
            x = x.gather(1, keep.unsqueeze(-1).expand(-1, -1, x.shape[-1]))
        if self.class_token is not None:
            x = torch.cat([(self.class_token + pos[:, : self.num_prefix]).expand(n, -1, -1), x], dim=1)
        return x, grid

    def _summary(self, x: torch.Tensor) -> torch.Tensor:
        return x[:, 0] if self.class_token is not None else x[:, self.num_prefix :].mean(1)

    def _position_embedding(self, grid: Tuple[int, int]) -> torch.Tensor:
        """(1, prefix + h * w, D): the embeddings of IMAGE_SIZE's grid, the patch part bicubically
        resized to ``grid`` when the input has another size."""
        pos = self.encoder.pos_embedding
        if grid == (self.grid, self.grid):
            return pos
        prefix, patches = pos[:, : self.num_prefix], pos[:, self.num_prefix :]
        width = pos.shape[-1]
        patches = patches.reshape(1, self.grid, self.grid, width).permute(0, 3, 1, 2)
        patches = F.interpolate(patches.float(), size=grid, mode="bicubic", align_corners=False)
        patches = patches.to(pos.dtype).permute(0, 2, 3, 1).reshape(1, grid[0] * grid[1], width)
        return torch.cat([prefix, patches], dim=1)


def build_vit(trunk_cfg) -> ViTTrunk:
    """Trunk for ``cfg.MODEL.TRUNK`` (uses its VIT section and OUT_FEATURES)."""
    vit_cfg = trunk_cfg.VIT
    depth, width, heads, mlp_dim = vit_dims(vit_cfg)
    return ViTTrunk(
        depth, width, heads, mlp_dim, vit_cfg.PATCH_SIZE, vit_cfg.IMAGE_SIZE, vit_cfg.CLASS_TOKEN,
        trunk_cfg.OUT_FEATURES, vit_cfg.MASK_TOKEN, vit_cfg.POSITION_EMBEDDING,
        vit_cfg.FROZEN_PATCH_PROJECTION, vit_cfg.DROP_PATH_RATE,
    )  # fmt: skip


def to_torchvision_state_dict(trunk_state_dict: Dict[str, torch.Tensor], prefix: str = "") -> Dict:
    """Trunk state dict -> state dict of ``torchvision.models.VisionTransformer(IMAGE_SIZE,
    PATCH_SIZE, depth, heads, width, mlp_dim)`` without ``heads`` (``vit_b_16()`` for a base/16 at
    224 px). Keys are already torchvision's; ``prefix`` is stripped as for RegNet. Load with
    ``tv.heads = nn.Identity()``; then ``tv(x)`` is our ``"cls"`` feature. torchvision's ViT always
    has a class token: a trunk without one has no torchvision counterpart (ValueError)."""
    # torchvision's ViT has no mask token: masked-image pretraining's is not needed to fine-tune
    kept = {k: v for k, v in trunk_state_dict.items() if k != f"{prefix}mask_token"}
    out = torchvision_keys(kept, prefix, TORCHVISION_PREFIXES, "ViT")
    if "class_token" not in out:
        raise ValueError(
            "a ViT without class token (MODEL.TRUNK.VIT.CLASS_TOKEN=False) has no torchvision counterpart"
        )
    return out


def load_line(trunk_cfg, library: str, path: str) -> str:
    """The lines that build the ``torchvision.models.VisionTransformer`` of ``trunk_cfg`` and load
    the torchvision export ``path`` (``model(x)``: our ``"cls"``)."""
    vit_cfg = trunk_cfg.VIT
    if library != "torchvision":
        raise ValueError(f"a ViT trunk has a torchvision model, not a {library} one")
    if not vit_cfg.CLASS_TOKEN:
        raise ValueError(
            "a ViT without class token (MODEL.TRUNK.VIT.CLASS_TOKEN=False) has no torchvision model"
        )
    depth, width, heads, mlp_dim = vit_dims(vit_cfg)
    build = (
        f"torchvision.models.VisionTransformer(image_size={vit_cfg.IMAGE_SIZE}, patch_size={vit_cfg.PATCH_SIZE}, "
        f"num_layers={depth}, num_heads={heads}, hidden_dim={width}, mlp_dim={mlp_dim})"
    )
    return torchvision_load_line(build, "heads", path)


def tokens(trunk_cfg) -> TokenLayout:
    """The ViT's patches, class token and mask token, from its config."""
    vit_cfg = trunk_cfg.VIT
    return TokenLayout(int(vit_cfg.PATCH_SIZE), bool(vit_cfg.CLASS_TOKEN), bool(vit_cfg.MASK_TOKEN))


VIT = TrunkFamily(
    build=build_vit,
    feature_names=feature_names,
    # a ViT has no stages: "stage" units and checkpoints are its blocks too
    units={"block": (EncoderBlock,), "stage": (EncoderBlock,)},
    checkpointed={"block": (EncoderBlock,), "stage": (EncoderBlock,)},
    torchvision_prefixes=TORCHVISION_PREFIXES,
    to_torchvision=to_torchvision_state_dict,
    names={"vits": ["custom", *VIT_SIZES], "vit_position_embeddings": list(POSITION_EMBEDDINGS)},
    load_line=load_line,
    tokens=tokens,
)
