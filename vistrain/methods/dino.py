"""DINO (Caron et al., 2021): self-distillation with a momentum teacher that sees the global crops
only, its output centred and sharpened (``vistrain/losses/dino.py``); head "dino": an MLP, L2
normalisation and a weight-normalised last layer kept in fp32 and frozen in the first epochs.
DINO's other settings: ``OPTIMIZER.clip_grad_per_parameter``, ``param_schedulers.weight_decay``
(0.04 -> 0.4) and the class token as the head's input (``MODEL.HEAD.INPUT_FEATURE: cls``).

DINOv2's terms (Oquab et al., 2023), each switched on in LOSS.dino_loss (all off by default: DINO
as it was): iBOT's masked-patch loss (``ibot_weight``; ``vistrain/losses/ibot.py``), the student's
global crops masked in blocks, a share ``mask_sample_probability`` of the images with ratios drawn
from ``mask_ratio_range``, the teacher unmasked; KoLeo on the student's class tokens
(``koleo_weight``; ``vistrain/losses/koleo.py``); Sinkhorn-Knopp centring of the teacher instead of
the centre (``centering``). They need the head on the ViT's token sequence (MODEL.HEAD.SEQUENCE:
the class token scored, and the masked patch tokens by the same head or by a separate iBOT head,
MODEL.HEAD.PATCH_OUT_DIM > 0). The masks come from the criterion's own generator (the run's seed
and the rank), saved with the rank's state: a resume on the same ranks draws the same masks.
"""

from typing import List, NamedTuple, Optional, Sequence

import torch
import torch.nn.functional as F
from fvcore.common.config import CfgNode
from torch import nn

from vistrain.config.checks import above, at_least, one_of, probability
from vistrain.config.errors import ConfigError
from vistrain.config.warmups import Warmup
from vistrain.distributed import comm
from vistrain.fsdp import params_of
from vistrain.losses.dino import DINOLoss, dino_cross_entropy, teacher_temperature
from vistrain.losses.ibot import (
    SINKHORN_ITERATIONS,
    IBOTPatchLoss,
    ibot_cross_entropy,
    sinkhorn_knopp_teacher,
)
from vistrain.losses.koleo import koleo_loss
from vistrain.methods.base import Criterion, Head, LossCollective, Method, global_crops_fit, modules_of
from vistrain.models.heads.mlp import MLP
from vistrain.models.masking import ibot_masked_bound, ibot_masks, mask_to
from vistrain.models.trunks import TokenLayout, token_layout

CENTERINGS = ("centre", "sinkhorn_knopp")


def section() -> CfgNode:
    """LOSS.dino_loss."""
    c = CfgNode()
    c.num_global_crops = 2  # the first crops: the teacher sees only these
    c.student_temp = 0.1
    c.teacher_temp = 0.04  # after the warm-up
    c.warmup_teacher_temp = 0.04  # linear from this over the warm-up epochs
    c.warmup_teacher_temp_epochs = 0
    c.center_momentum = 0.9  # the centre's EMA over the global batch's teacher outputs
    c.freeze_last_layer_epochs = 1  # the head's last layer gets no update this long
    c.momentum_teacher = 0.996  # m0: cosine from m0 to 1 over the run
    # the teacher's targets: "centre" (centred and sharpened) or "sinkhorn_knopp" (DINOv2: 3
    # Sinkhorn-Knopp iterations over the global batch, for the class and the patch targets)
    c.centering = "centre"
    # iBOT's masked-patch loss (0: off; DINOv2 1.0): the student's global crops are masked, their
    # masked patch tokens predict the teacher's (MODEL.HEAD.SEQUENCE, MODEL.TRUNK.VIT.MASK_TOKEN)
    c.ibot_weight = 0.0
    c.koleo_weight = 0.0  # KoLeo on the student's class tokens of each global crop (0: off; DINOv2 0.1)
    c.mask_ratio_range = [0.1, 0.5]  # iBOT: a masked image's share of masked patches, drawn from here
    c.mask_sample_probability = 0.5  # iBOT: share of the global crops' images that are masked
    return c


def head_keys() -> CfgNode:
    """MODEL.HEAD keys of the dino head."""
    c = CfgNode()
    c.OUT_DIM = 1024  # dino: width K of the weight-normalised last layer (DINO: 65536)
    c.NORM_LAST_LAYER = True  # dino: the last layer's row norms fixed at 1 (False: learnt)
    # dino: read the ViT's token sequence (MODEL.TRUNK.OUT_FEATURES [sequence]), not avgpool:
    # score the class token, and the patch tokens (iBOT, KoLeo: LOSS.dino_loss)
    c.SEQUENCE = False
    c.PATCH_OUT_DIM = 0  # dino, SEQUENCE: 0: the head scores the patches too; > 0: an iBOT head this wide
    return c


# ---------------------------------------------------------------------------------------- head


class DINOLastLayer(nn.Linear):
    """DINO's weight-normalised last layer: ``logits = z W^T`` with ``W = g * V / ||V||`` row by
    row, (N, B) -> (N, K) in float32, no bias.

    DINO: "a weight normalized fully connected layer with K dimensions" (``nn.utils.weight_norm``,
    ``weight_g`` filled with 1). ``norm_last_layer`` (DINO's default) keeps g at 1: no ``weight_g``
    parameter at all; else ``weight_g`` (K, 1) starts at 1 and is learnt. Computed here directly (no
    forward hooks, so the sharded engine's views stay the only weights); ``weight`` is V. Its own
    class: a wrap policy keeps it a separate full-precision unit, which the first epoch freezes.
    """

    def __init__(self, dim: int, out_dim: int, norm_last_layer: bool = True):
        super().__init__(dim, out_dim, bias=False)
        self.weight_g = None if norm_last_layer else nn.Parameter(torch.ones(out_dim, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = torch.promote_types(x.dtype, torch.float32)
        with torch.autocast(device_type="cpu" if x.is_meta else x.device.type, enabled=False):
            weight = F.normalize(self.weight.to(dtype), dim=1, p=2)
            if self.weight_g is not None:
                weight = weight * self.weight_g.to(dtype)
            return F.linear(x.to(dtype), weight)


class DINOHead(nn.Module):
    """``forward(x)``: x (N, dims[0]) -> logits (N, out_dim), float32.

    DINO: "a 3-layer multi-layer perceptron (MLP) with hidden dimension 2048 followed by l2
    normalization and a weight normalized fully connected layer with K dimensions"; GELU between
    the MLP layers, ``dims`` = [input, hidden..., bottleneck] (DINO: [*, 2048, 2048, 256]).
    """

    in_feature = "avgpool"

    def __init__(self, dims: Sequence[int], use_bn: bool, out_dim: int, norm_last_layer: bool = True):
        super().__init__()
        if out_dim <= 0:
            raise ConfigError(f"MODEL.HEAD.OUT_DIM must be positive, got {out_dim}")
        self.projection = MLP(dims, use_bn, activation="gelu")
        self.last_layer = DINOLastLayer(self.projection.dims[-1], out_dim, norm_last_layer)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.last_layer(F.normalize(self.projection(x), dim=-1, p=2))


class DINOTokens(NamedTuple):
    """The head's output on the token sequence, crop by crop (rows c*N .. (c+1)*N-1: crop c)."""

    class_logits: torch.Tensor  # (C*N, K) of the class tokens
    class_tokens: torch.Tensor  # (C*N, D) the class tokens themselves (KoLeo reads them)
    patch_logits: Optional[torch.Tensor]  # (M, K'): the masked patches (see DINOTokensHead)


class DINOTokensHead(DINOHead):
    """DINO's head on the ViT's token sequence (iBOT, DINOv2): ``forward(sequences, mask=None)``
    -> :class:`DINOTokens`, float32 logits.

    ``sequences``: one (n_r, 1 + L_r, D) "sequence" per run of crops of one resolution (class
    token first); ``mask``: one (n_r, L_r) bool or None per run, or None: the patches scored are
    the masked ones, selected before the head, in ``mask.nonzero()`` order (``patch_logits`` None
    where no patch is masked), as DINOv2's ``ssl_meta_arch.py`` selects them for the student and
    for the teacher (which sees the crops unmasked: ``SSLModel``'s ``head_mask``). The class
    tokens go through the DINO head; the patch tokens through it too (iBOT with DINO's head) or
    through ``patch_head``, a head of the same dims with its own last layer ``patch_out_dim``
    wide (DINOv2's separate iBOT head). Each kind of token is its own batch (its own BatchNorm
    statistics, when the head has BatchNorm: the teacher's, like the student's, see the masked
    patches only; DINOv2's shared head, without BatchNorm by default, runs both kinds at once).
    """

    in_feature = "sequence"
    by_resolution = True  # SSLModel hands it a list: sequences of two resolutions do not concatenate

    def __init__(self, dims, use_bn: bool, out_dim: int, norm_last_layer: bool, patch_out_dim: int):
        super().__init__(dims, use_bn, out_dim, norm_last_layer)
        separate = patch_out_dim > 0
        self.patch_head = DINOHead(dims, use_bn, patch_out_dim, norm_last_layer) if separate else None

    def forward(self, sequences: Sequence[torch.Tensor], mask=None) -> DINOTokens:
        class_tokens = torch.cat([s[:, 0] for s in sequences])
        patches = [s[:, 1:][m] for s, m in zip(sequences, mask or ()) if m is not None]
        class_logits = super().forward(class_tokens)
        if not patches:
            return DINOTokens(class_logits, class_tokens, None)
        patches = torch.cat(patches)
        patch_logits = self.patch_head(patches) if self.patch_head is not None else super().forward(patches)
        return DINOTokens(class_logits, class_tokens, patch_logits)


def build_head(head_cfg) -> DINOHead:
    if head_cfg.PATCH_OUT_DIM and not head_cfg.SEQUENCE:
        raise ConfigError("MODEL.HEAD.PATCH_OUT_DIM > 0 scores patch tokens: set MODEL.HEAD.SEQUENCE=True")
    if head_cfg.SEQUENCE:
        return DINOTokensHead(
            head_cfg.DIMS, head_cfg.USE_BN, head_cfg.OUT_DIM, head_cfg.NORM_LAST_LAYER, head_cfg.PATCH_OUT_DIM
        )
    return DINOHead(head_cfg.DIMS, head_cfg.USE_BN, head_cfg.OUT_DIM, head_cfg.NORM_LAST_LAYER)


class PatchMasks(nn.Module):
    """The iBOT masks of the student's global crops, ``forward(crops) -> (G*N, L)`` bool (crop by
    crop, ``models.masking.ibot_masks`` over the G*N images), from this rank's own generator:
    seeded from the run's seed (set before the criterion is built) and the rank, so ranks mask
    their images independently; its state is part of ``state_dict()``."""

    def __init__(self, patch_size: int, ratio_range: Sequence[float], sample_probability: float):
        super().__init__()
        self.patch_size, self.ratio_range = patch_size, tuple(float(r) for r in ratio_range)
        self.sample_probability = float(sample_probability)
        self.generator = torch.Generator().manual_seed(torch.initial_seed() + 7919 * comm.get_rank())

    def forward(self, crops: Sequence[torch.Tensor]) -> torch.Tensor:
        if len({tuple(c.shape) for c in crops}) != 1:
            raise ValueError(f"the masked crops must have one size, got {[tuple(c.shape) for c in crops]}")
        n, _, height, width = crops[0].shape
        grid = (height // self.patch_size, width // self.patch_size)
        return ibot_masks(len(crops) * n, grid, self.ratio_range, self.sample_probability, self.generator)

    def get_extra_state(self):
        return {"generator": self.generator.get_state()}

    def set_extra_state(self, state) -> None:
        self.generator.set_state(state["generator"])


# ----------------------------------------------------------------------------------- criterion


class DINOCriterion(Criterion):
    """DINO on logits (C*N, K): rows [c*N, (c+1)*N) are crop c, the ``num_global_crops`` first
    crops are the global ones; the teacher sees only those, (G*N, K). With MODEL.HEAD.SEQUENCE
    both give :class:`DINOTokens`; ``masking`` masks the student's global crops for iBOT.

    Per-step state: the centres (``loss.center``, ``ibot.center``, equal on every rank:
    all-reduced), the mask generator (``masks``, per rank), the teacher temperature (warm-up by
    epoch), the last layers frozen during the first ``freeze_last_layer_epochs`` epochs (DINO's
    ``cancel_gradients_last_layer``). The loss: ``dino + koleo_weight * sum over the global crops
    of KoLeo + ibot_weight * iBOT`` (DINOv2's ``forward_backward``).
    """

    def __init__(self, dino_cfg, model_cfg=None):
        super().__init__()
        if model_cfg is None:
            raise ValueError("dino_loss needs MODEL (build it with build_method(cfg))")
        self.cfg = dino_cfg
        self.num_global_crops = int(dino_cfg.num_global_crops)
        self.teacher_momentum = float(dino_cfg.momentum_teacher)
        self.loss = DINOLoss(int(model_cfg.HEAD.OUT_DIM), dino_cfg.student_temp, dino_cfg.center_momentum)
        self.epoch = 0
        self.sequence = bool(model_cfg.HEAD.SEQUENCE)
        self.ibot_weight, self.koleo_weight = float(dino_cfg.ibot_weight), float(dino_cfg.koleo_weight)
        if self.ibot_weight > 0:
            width = int(model_cfg.HEAD.PATCH_OUT_DIM or model_cfg.HEAD.OUT_DIM)
            self.ibot = IBOTPatchLoss(width, dino_cfg.student_temp, dino_cfg.center_momentum)
            self.masks = PatchMasks(
                _layout(model_cfg.TRUNK).patch_size,
                dino_cfg.mask_ratio_range,
                dino_cfg.mask_sample_probability,
            )
        self._pending: Optional[List[torch.Tensor]] = None  # the (N, L) masks per global crop of masking()

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def teacher_temp(self) -> float:
        c = self.cfg
        return teacher_temperature(
            self.epoch, c.warmup_teacher_temp, c.teacher_temp, int(c.warmup_teacher_temp_epochs)
        )

    def teacher_crops(self, crops):
        return crops[: self.num_global_crops]

    def masking(self, crops: Sequence[torch.Tensor]):
        """``mask``: one (N, L) mask per global crop (none without iBOT: the head then scores no
        patch); nothing for the head on avgpool."""
        if not self.sequence or self.ibot_weight == 0:
            return {}
        masks = self.masks(crops[: self.num_global_crops])
        self._pending = list(mask_to(masks, crops[0].device).chunk(self.num_global_crops))
        return {"mask": self._pending}

    def teacher_masking(self):
        """``head_mask``: the masks ``masking`` drew, for the teacher's head alone (its trunk sees
        the global crops whole): it scores the same patches as the student, as DINOv2."""
        return {} if self._pending is None else {"head_mask": self._pending}

    def forward(self, model_output, num_crops: int, teacher_output=None) -> torch.Tensor:
        if teacher_output is None:
            raise ValueError("dino_loss needs the teacher's output")
        if num_crops < max(self.num_global_crops, 2):
            raise ValueError(
                f"dino_loss needs the {self.num_global_crops} global crops and at least 2 crops, got {num_crops}"
            )
        if not self.sequence:
            return self._dino(model_output.chunk(num_crops), teacher_output.chunk(self.num_global_crops))
        student, teacher = model_output, teacher_output
        loss = self._dino(
            student.class_logits.chunk(num_crops), teacher.class_logits.chunk(self.num_global_crops)
        )
        if self.koleo_weight > 0:
            tokens = student.class_tokens.chunk(num_crops)[: self.num_global_crops]
            loss = loss + self.koleo_weight * sum(koleo_loss(crop) for crop in tokens)
        if self.ibot_weight > 0:
            loss = loss + self.ibot_weight * self._ibot(student.patch_logits, teacher.patch_logits)
        return loss

    def _dino(self, student: Sequence[torch.Tensor], teacher: Sequence[torch.Tensor]) -> torch.Tensor:
        """DINO's loss with the centre, or on Sinkhorn-Knopp targets of the G*N teacher rows."""
        if self.cfg.centering == "centre":
            return self.loss(student, teacher, self.teacher_temp())
        targets = sinkhorn_knopp_teacher(torch.cat(teacher), self.teacher_temp())
        return dino_cross_entropy(student, targets.chunk(len(teacher)), self.loss.student_temp)

    def _ibot(self, student: torch.Tensor, teacher: torch.Tensor) -> torch.Tensor:
        """iBOT on the masked patches: the student's (M, K') against the teacher's (M, K') of the
        same patches (both heads scored the patches of the masks ``masking`` drew)."""
        masks, self._pending = self._pending, None
        if masks is None or teacher is None or teacher.shape != student.shape:
            raise ValueError(
                "dino_loss with ibot_weight > 0 scores the patches masking() masked, the teacher's "
                "with teacher_masking(): call both before the forwards"
            )
        masks = torch.cat(masks).to(teacher.device)
        if self.cfg.centering == "centre":
            return self.ibot(student, teacher, masks, self.teacher_temp())
        targets = sinkhorn_knopp_teacher(teacher, self.teacher_temp())
        return ibot_cross_entropy(student, targets, masks, self.ibot.student_temp)

    def frozen_params(self, model: nn.Module, iteration: int) -> List[nn.Parameter]:
        if self.epoch >= self.cfg.freeze_last_layer_epochs:
            return []
        return [param for module in modules_of(model, DINOLastLayer, "dino") for param in params_of(module)]

    def load_shared_state(self, state: dict) -> None:
        self.loss.center.copy_(state["loss.center"])
        if self.ibot_weight > 0 and "ibot.center" in state:
            self.ibot.center.copy_(state["ibot.center"])


def _layout(trunk_cfg) -> TokenLayout:
    layout = token_layout(trunk_cfg)
    if isinstance(layout, str):
        raise ConfigError(f"DINOv2's terms read a ViT's patches: {layout}")
    return layout


def tokens_fit(cfg: CfgNode) -> Optional[str]:
    """A method check: DINOv2's terms read the ViT's tokens, iBOT masks them."""
    c, head, trunk = cfg.LOSS.dino_loss, cfg.MODEL.HEAD, cfg.MODEL.TRUNK
    if (c.ibot_weight > 0 or c.koleo_weight > 0) and not head.SEQUENCE:
        return (
            "LOSS.dino_loss.ibot_weight and koleo_weight score the ViT's tokens: set MODEL.HEAD.SEQUENCE=True"
        )
    if not head.SEQUENCE:
        return None
    layout = token_layout(trunk)
    if isinstance(layout, str) or not layout.class_token or "sequence" not in trunk.OUT_FEATURES:
        why = layout if isinstance(layout, str) else f"class token: {layout.class_token}"
        return (
            "MODEL.HEAD.SEQUENCE=True reads a ViT's class and patch tokens: a ViT with a class token "
            f"(vit, or timm's VisionTransformer) and MODEL.TRUNK.OUT_FEATURES=[sequence] (now {trunk.NAME}: "
            f"{why}; {list(trunk.OUT_FEATURES)})"
        )
    if c.ibot_weight > 0 and not layout.mask_token:
        return (
            "LOSS.dino_loss.ibot_weight > 0 masks the student's patches: set MODEL.TRUNK.VIT.MASK_TOKEN=True "
            "(a timm ViT: MODEL.TRUNK.TIMM.MASK_TOKEN=True)"
        )
    if head.PATCH_OUT_DIM and c.ibot_weight == 0:
        return "MODEL.HEAD.PATCH_OUT_DIM > 0 is an iBOT head that only LOSS.dino_loss.ibot_weight > 0 trains"
    return None


def ratio_range(value, _) -> Optional[str]:
    """A rule: a [low, high] pair with 0 <= low <= high < 1."""
    if len(value) == 2 and 0 <= value[0] <= value[1] < 1:
        return None
    return f"must be [low, high] with 0 <= low <= high < 1; got {list(value)}"


def collectives(cfg: CfgNode, world: int) -> List[LossCollective]:
    """The centre's all-reduce of the teacher outputs' sum, (1, K) in fp32; with Sinkhorn-Knopp
    instead its max, mass and count, and its row sums per iteration; iBOT's the same on K'."""
    c, head = cfg.LOSS.dino_loss, cfg.MODEL.HEAD
    widths = [head.OUT_DIM] + ([head.PATCH_OUT_DIM or head.OUT_DIM] if c.ibot_weight > 0 else [])
    if c.centering == "centre":  # iBOT's centre: its sum and its count
        return [LossCollective("all_reduce", (k + i) * 4, 1) for i, k in enumerate(widths)]
    out = []
    for k in widths:
        out += [LossCollective("all_reduce", 4, 1), LossCollective("all_reduce", 8, 1)]
        out.append(LossCollective("all_reduce", k * 4, SINKHORN_ITERATIONS))
    return out


def loss_memory(cfg: CfgNode) -> int:
    """The teacher's output, alive from before the student's forward to the end of its backward
    (fp32): the class logits (G*N, K), with the head on the sequence the class tokens (G*N, DIMS[0]) and,
    with iBOT, the logits of the masked patches of the global crops (M, K'), M at most
    ``ibot_masked_bound`` of the G*N images of L = (side / patch)^2 patches."""
    c, head, transforms = cfg.LOSS.dino_loss, cfg.MODEL.HEAD, cfg.DATA.TRAIN.TRANSFORMS
    rows = int(c.num_global_crops) * cfg.DATA.TRAIN.BATCHSIZE_PER_REPLICA
    elements = rows * head.OUT_DIM
    if head.SEQUENCE:
        elements += rows * head.DIMS[0]  # the class tokens, the trunk's width
    if head.SEQUENCE and c.ibot_weight > 0:
        patches = (transforms.SIZE_CROPS[0] // _layout(cfg.MODEL.TRUNK).patch_size) ** 2
        masked = ibot_masked_bound(rows, patches, c.mask_ratio_range, c.mask_sample_probability)
        elements += masked * (head.PATCH_OUT_DIM or head.OUT_DIM)
    return elements * 4


HEAD = Head("dino", build_head, head_keys, fp32_units=(DINOLastLayer,))  # frozen first: its own shards

METHOD = Method(
    name="dino_loss",
    criterion=DINOCriterion,
    head=HEAD,
    section=section,
    rules={
        "centering": [one_of(CENTERINGS)],
        "ibot_weight": [at_least(0.0)],
        "koleo_weight": [at_least(0.0)],
        "mask_ratio_range": [ratio_range],
        "mask_sample_probability": [above(0.0), probability],
    },
    checks=(global_crops_fit, tokens_fit),
    teacher=True,
    collectives=collectives,
    loss_memory=loss_memory,
    # linspace(warmup, final, W)[epoch]: the final temperature from epoch W - 1 on
    warmups=(Warmup("warmup_teacher_temp_epochs", "epochs", 1), Warmup("freeze_last_layer_epochs", "epochs")),
)
