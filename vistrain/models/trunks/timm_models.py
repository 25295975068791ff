"""Any timm model as a trunk (``MODEL.TRUNK.NAME: timm``; ``pip install -e ".[timm]"``).

``MODEL.TRUNK.TIMM.NAME`` is any ``timm.create_model`` name and ``MODEL.TRUNK.TIMM.KWARGS`` its
keyword arguments (``img_size``, ``patch_size``, ``drop_path_rate``...); the input channels are
``MODEL.TRUNK.IN_CHANNELS`` (timm's ``in_chans``). The model is built with ``num_classes=0`` and
kept unchanged at ``trunk.timm``, so its parameter names are timm's own: weights load with timm's
keys and export to a file ``timm.create_model(name, num_classes=0, checkpoint_path=...)`` reads.

Features, from timm's own metadata:

* ``stage1..stageK``: the outputs timm's ``feature_info`` lists (a CNN's stages, a ViT's blocks),
  as (N, C, h, w) maps through ``forward_intermediates`` (models that have it);
* a token model (one with ``num_prefix_tokens``: ViT, DeiT, EVA...): ``cls`` (N, D) the class
  token, ``avgpool`` (N, D) the mean patch token, ``tokens`` (N, D, h, w) the patch tokens as a
  map, ``sequence`` (N, prefix + L, D) every token, all after the final norm (``forward_features``);
* any other model: ``avgpool`` (N, C), timm's pooled pre-logits feature (``forward_head(x,
  pre_logits=True)``: its global pool and head norm).
"""

import difflib
from typing import Dict, List, Optional, Tuple, Union

import torch
from torch import nn

from vistrain.config.errors import ConfigError
from vistrain.models.trunks.family import TokenLayout, TrunkFamily
from vistrain.models.trunks.library import LibraryTrunk, keyword_arguments, meta_build
from vistrain.models.trunks.structure import classes_named

TOKEN_FEATURES = ("cls", "avgpool", "tokens", "sequence")


def import_timm():
    """The timm module; ConfigError (one line naming the install) without it."""
    try:
        import timm
    except ImportError:
        raise ConfigError('MODEL.TRUNK.NAME timm needs timm: pip install -e ".[timm]"') from None
    return timm


def create_kwargs(trunk_cfg) -> dict:
    """``MODEL.TRUNK.TIMM.KWARGS`` with ``in_chans`` from ``MODEL.TRUNK.IN_CHANNELS`` and
    ``num_classes=0``; ValueError (one line) for keys that have a key of their own."""
    kwargs = keyword_arguments(trunk_cfg.TIMM.KWARGS, "MODEL.TRUNK.TIMM.KWARGS")
    for key in ("num_classes", "pretrained"):
        if key in kwargs:
            raise ValueError(
                f"MODEL.TRUNK.TIMM.KWARGS.{key}: a trunk has no classifier and loads weights through "
                "MODEL.WEIGHTS_INIT.PARAMS_FILE; remove it"
            )
    if kwargs.get("in_chans", trunk_cfg.IN_CHANNELS) != trunk_cfg.IN_CHANNELS:
        raise ValueError(
            f"MODEL.TRUNK.TIMM.KWARGS.in_chans ({kwargs['in_chans']}) differs from MODEL.TRUNK.IN_CHANNELS "
            f"({trunk_cfg.IN_CHANNELS}): set MODEL.TRUNK.IN_CHANNELS only"
        )
    return {**kwargs, "in_chans": trunk_cfg.IN_CHANNELS, "num_classes": 0}


def create(trunk_cfg) -> nn.Module:
    """``timm.create_model(NAME, num_classes=0, in_chans=IN_CHANNELS, **KWARGS)``; ValueError
    (one line) for an unknown name (listing close ones) or arguments the model refuses."""
    timm = import_timm()
    name = trunk_cfg.TIMM.NAME
    if not timm.is_model(name):
        close = difflib.get_close_matches(name, timm.list_models(), n=6, cutoff=0.5)
        hint = f"close names: {', '.join(close)}" if close else "see timm.list_models()"
        raise ValueError(f"unknown MODEL.TRUNK.TIMM.NAME {name!r} ({hint})")
    try:
        return timm.create_model(name, pretrained=False, **create_kwargs(trunk_cfg))
    except TypeError as e:
        raise ValueError(f"timm.create_model({name!r}) refused MODEL.TRUNK.TIMM.KWARGS: {e}") from None


def _layout(model: nn.Module) -> Tuple[List[str], Dict[str, int], List[str]]:
    """(stage names, every feature -> channels, the (N, C) features) of a timm model."""
    stages: List[str] = []
    dims: Dict[str, int] = {}
    if callable(getattr(model, "forward_intermediates", None)):
        for i, info in enumerate(model.feature_info):
            stages.append(f"stage{i + 1}")
            dims[stages[-1]] = int(info["num_chs"])
    width = int(getattr(model, "head_hidden_size", None) or model.num_features)
    if is_token_model(model):
        pooled = [n for n in TOKEN_FEATURES if n != "cls" or getattr(model, "cls_token", None) is not None]
        dims.update(dict.fromkeys(pooled, int(model.num_features)))
        vectors = [n for n in pooled if n not in ("tokens", "sequence")]
    else:
        dims["avgpool"], vectors = width, ["avgpool"]
    return stages, dims, vectors


def is_token_model(model: nn.Module) -> bool:
    """A transformer over a token sequence whose first ``num_prefix_tokens`` are not patches."""
    return isinstance(getattr(model, "num_prefix_tokens", None), int)


def maskable(model: nn.Module) -> Optional[str]:
    """None when masked-image methods can mask ``model`` (a timm ``VisionTransformer`` with
    absolute position embeddings and square patches, its prefix the class and register tokens);
    else one line saying why not."""
    from timm.models.vision_transformer import VisionTransformer

    name = type(model).__name__
    if not isinstance(model, VisionTransformer) or getattr(model, "pos_embed", None) is None:
        return f"timm {name} is no VisionTransformer with absolute position embeddings: masked methods cannot mask it"
    prefix = int(model.cls_token is not None) + (
        model.reg_token.shape[1] if model.reg_token is not None else 0
    )
    patch = tuple(model.patch_embed.patch_size)
    if prefix != model.num_prefix_tokens or patch[0] != patch[1]:
        return f"timm {name} has prefix tokens or patches masked methods do not know (a distillation token, non-square patches)"
    return None


class TimmTrunk(LibraryTrunk):
    """A timm model without classifier (``self.timm``). ``forward(x)``: x (N, IN_CHANNELS, H, W)
    -> {name: feature} for the requested ``out_features`` (module docstring); a model stops after
    the last requested stage when no pooled feature is requested.

    Masked-image modelling on a maskable ViT (:func:`maskable`), through timm's public modules
    (``patch_embed``, ``cls_token``, ``reg_token``, ``pos_embed``, ``blocks``, ``norm``), as the
    built-in ViT: ``forward(x, keep=...)`` with ``keep`` (N, K) encodes those patches only, each
    with its position embedding (MAE); ``forward(x, mask=...)`` with a boolean (N, L) replaces
    the masked patch embeddings by the trunk's learned ``mask_token`` (``MODEL.TRUNK.TIMM.MASK_TOKEN``,
    zeros at start as iBOT's) before the position embeddings (iBOT, DINOv2). ``patch_size``, ``grid``
    (patches per side at the model's ``img_size``) and ``num_prefix`` are MAE's decoder's."""

    def __init__(self, model: nn.Module, out_features, blocks=(), mask_token: bool = False):
        super().__init__()
        self.timm = model
        self.stages, dims, vectors = _layout(model)
        self.token_model = is_token_model(model)
        if maskable(model) is None:
            self.patch_size = int(model.patch_embed.patch_size[0])
            self.grid, self.num_prefix = int(model.patch_embed.grid_size[0]), int(model.num_prefix_tokens)
        if mask_token:
            self.mask_token = nn.Parameter(torch.zeros(1, 1, int(model.num_features)))
        else:
            self.register_parameter("mask_token", None)
        self.setup(model, dims, vectors, out_features, blocks, f"timm {type(model).__name__}")

    def forward(
        self, x: torch.Tensor, keep: Optional[torch.Tensor] = None, mask: Optional[torch.Tensor] = None
    ) -> Dict[str, torch.Tensor]:
        wanted = set(self.out_features)
        if keep is not None or mask is not None:
            if wanted & set(self.stages) or (keep is not None and "tokens" in wanted):
                raise ValueError("a masked forward gives the pooled features and the sequence only")
            return self._pooled(self._masked_sequence(x, keep, mask), x.shape[-2:], wanted)
        indices = [i for i, name in enumerate(self.stages) if name in wanted]
        pooled = bool(wanted - set(self.stages))
        out: Dict[str, torch.Tensor] = {}
        if indices:
            result = self.timm.forward_intermediates(
                x, indices=indices, output_fmt="NCHW", stop_early=not pooled, intermediates_only=not pooled
            )
            final, maps = result if pooled else (None, result)
            out.update(zip((self.stages[i] for i in indices), maps))
        else:
            final = self.timm.forward_features(x)
        if pooled:
            out.update(self._pooled(final, x.shape[-2:], wanted))
        return out

    def _pooled(self, final: torch.Tensor, size, wanted) -> Dict[str, torch.Tensor]:
        """The pooled features of ``forward_features``' output (module docstring)."""
        if not self.token_model:
            return {"avgpool": self.timm.forward_head(final, pre_logits=True)}
        prefix = self.timm.num_prefix_tokens
        out = {"sequence": final} if "sequence" in wanted else {}
        patches = final[:, prefix:]
        if "cls" in wanted:
            out["cls"] = final[:, 0]
        if "avgpool" in wanted:
            out["avgpool"] = patches.mean(1)
        if "tokens" in wanted:
            grid = self._grid(size, patches.shape[1])
            out["tokens"] = patches.transpose(1, 2).reshape(patches.shape[0], -1, *grid)
        return out

    def _masked_sequence(
        self, x: torch.Tensor, keep: Optional[torch.Tensor], mask: Optional[torch.Tensor]
    ) -> torch.Tensor:
        """(N, prefix + L', D) after the final norm: timm's ``forward_features`` with the patches
        masked (``mask``) or only the kept ones encoded (``keep``)."""
        m = self.timm
        problem = maskable(m)
        if problem is not None:
            raise ValueError(problem)
        x = m.patch_embed(x)  # (N, L, D), or (N, h, w, D) with dynamic_img_size
        grid = tuple(x.shape[1:3]) if x.dim() == 4 else tuple(m.patch_embed.grid_size)
        x = x.flatten(1, 2) if x.dim() == 4 else x
        if mask is not None:
            if self.mask_token is None:
                raise ValueError("a mask needs the trunk's mask token: set MODEL.TRUNK.TIMM.MASK_TOKEN=True")
            x = torch.where(mask.to(x.device).unsqueeze(-1), self.mask_token.to(x.dtype), x)
        prefix_pos, pos = self._position_embeddings(grid)
        x = x + pos
        if keep is not None:
            x = x.gather(1, keep.unsqueeze(-1).expand(-1, -1, x.shape[-1]))
        prefix = [t.expand(x.shape[0], -1, -1) for t in (m.cls_token, m.reg_token) if t is not None]
        if prefix:
            prefix = torch.cat(prefix, dim=1)
            x = torch.cat([prefix + prefix_pos if prefix_pos is not None else prefix, x], dim=1)
        x = m.norm_pre(m.patch_drop(m.pos_drop(x)))
        for block in m.blocks:
            x = block(x)
        return m.norm(x)

    def _position_embeddings(self, grid: Tuple[int, int]) -> Tuple[Optional[torch.Tensor], torch.Tensor]:
        """(the prefix tokens' position embeddings or None, the patches' (1, h * w, D)), resampled
        (timm's ``resample_abs_pos_embed``) for a patch ``grid`` other than ``img_size``'s."""
        from timm.layers import resample_abs_pos_embed

        m = self.timm
        pos, own = m.pos_embed, tuple(m.patch_embed.grid_size)
        start = 0 if m.no_embed_class else m.num_prefix_tokens
        if grid != own:
            pos = resample_abs_pos_embed(pos, new_size=grid, old_size=own, num_prefix_tokens=start)
        return (pos[:, :start] if start else None), pos[:, start:]

    def _grid(self, size, count: int) -> Tuple[int, int]:
        patch = getattr(getattr(self.timm, "patch_embed", None), "patch_size", None)
        if patch is None:
            side = int(round(count**0.5))
            return side, count // max(side, 1)
        return size[0] // patch[0], size[1] // patch[1]


def build_timm(trunk_cfg) -> TimmTrunk:
    """Trunk for ``cfg.MODEL.TRUNK`` (its TIMM section, IN_CHANNELS and OUT_FEATURES)."""
    timm_cfg = trunk_cfg.TIMM
    return TimmTrunk(create(trunk_cfg), trunk_cfg.OUT_FEATURES, timm_cfg.BLOCKS, timm_cfg.MASK_TOKEN)


def tokens(trunk_cfg) -> Union[TokenLayout, str]:
    """The patches, class token and mask token of a maskable timm ViT (a meta-device build), or
    one line saying why masked methods cannot mask the model."""
    model = meta_build(create, trunk_cfg) or create(trunk_cfg)
    problem = maskable(model)
    if problem is not None:
        return problem
    patch = int(model.patch_embed.patch_size[0])
    return TokenLayout(patch, model.cls_token is not None, bool(trunk_cfg.TIMM.MASK_TOKEN))


def feature_names(trunk_cfg) -> List[str]:
    """Every feature the timm model of ``trunk_cfg`` offers, from a meta-device build (no memory);
    ValueError (one line) for a name, keyword or BLOCKS class the model does not have."""
    model = meta_build(create, trunk_cfg) or create(trunk_cfg)
    if trunk_cfg.TIMM.BLOCKS:
        classes_named(model, trunk_cfg.TIMM.BLOCKS, "MODEL.TRUNK.TIMM.BLOCKS")  # one line if one is unknown
    _, dims, _ = _layout(model)
    return list(dims)


def to_timm_state_dict(trunk_state_dict: Dict, prefix: str = "") -> Dict:
    """Trunk state dict (keys after ``prefix``, e.g. ``"trunk."``) -> timm's own state dict of
    the model (``timm.create_model(NAME, num_classes=0, **KWARGS).load_state_dict``)."""
    start = prefix + "timm."
    out = {k[len(start) :]: v for k, v in trunk_state_dict.items() if k.startswith(start)}
    if not out:
        raise ValueError(f"no timm trunk keys found (prefix {start!r})")
    return out


def _no_torchvision(trunk_state_dict: Dict, prefix: str = "") -> Dict:
    raise ValueError("a timm trunk has no torchvision counterpart: export it with --to-timm")


def load_line(trunk_cfg, library: str, path: str) -> str:
    """The line that builds this trunk in timm and loads the exported file ``path``."""
    kwargs = {k: v for k, v in create_kwargs(trunk_cfg).items() if k not in ("num_classes",)}
    if kwargs.get("in_chans") == 3:
        del kwargs["in_chans"]
    args = "".join(f", {k}={v!r}" for k, v in kwargs.items())
    return f"timm.create_model({trunk_cfg.TIMM.NAME!r}, num_classes=0, checkpoint_path={path!r}{args})"


TIMM = TrunkFamily(
    build=build_timm,
    feature_names=feature_names,
    units={},  # the blocks of the built model: LibraryTrunk.block_classes
    checkpointed={},
    torchvision_prefixes=("timm",),
    to_torchvision=_no_torchvision,
    to_timm=to_timm_state_dict,
    load_line=load_line,
    tokens=tokens,
    builds_in_channels=True,
)
