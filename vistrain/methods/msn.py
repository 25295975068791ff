"""MSN (Assran et al., 2022): "Masked Siamese Networks ... match the representation of an image
view containing randomly masked patches to the representation of the original unmasked image".

The first crop of each image is the target view: the momentum teacher (an EMA of the student,
cosine from ``momentum_teacher`` to 1) sees it whole. The other crops are the anchor views the
student sees: the random crops of the first resolution lose a share ``mask_ratio`` of their
patches (dropped before the encoder, ``keep=``, as the authors' ``patch_drop``), the smaller
focal crops go whole (as the authors' code: its patch drop masks the first run of crops only).
Head "msn": the authors' 3-layer projection (Linear, BatchNorm, GELU twice, then a Linear) and K
learnable prototypes (a separate full-precision unit, saved with the model). The loss
(``vistrain/losses/msn.py``): the anchors' soft assignments to the prototypes predict the
target's sharpened one, plus the me-max regulariser over the global batch.

The masks are drawn per image and per step from the criterion's own generator, seeded from the
run's seed and the rank and saved in every checkpoint (as MAE's); the authors' code drops the
same patches from every image of a batch. Their prototypes' gradient is summed over the ranks,
the encoder's averaged; here both are averaged (AdamW: the same steps, up to its epsilon).
"""

from typing import Dict, List, NamedTuple, Optional, Sequence

import torch
import torch.nn.functional as F
from fvcore.common.config import CfgNode
from torch import nn

from vistrain.config.checks import above, at_least, below, probability
from vistrain.config.errors import ConfigError
from vistrain.distributed import comm
from vistrain.losses.msn import msn_loss
from vistrain.methods.base import Criterion, Head, LossCollective, Method
from vistrain.models.heads.mlp import MLP
from vistrain.models.masking import random_keep
from vistrain.models.trunks import token_layout


def section() -> CfgNode:
    """LOSS.msn_loss (the defaults: the authors' ViT-S/16 recipe)."""
    c = CfgNode()
    c.momentum_teacher = 0.996  # m0 of the target encoder's EMA: cosine from m0 to 1 (MSN: linearly)
    c.mask_ratio = 0.15  # share of the patches dropped from the anchors of the first resolution (ViT-S: 0.15)
    c.temperature = 0.1  # tau of every soft assignment to the prototypes
    c.sharpen_temperature = 0.25  # T of the targets' sharpening: their temperature is tau T = 0.025
    c.sinkhorn_iterations = 3  # Sinkhorn-Knopp on the targets over the global batch (0: off; MSN ViT-S: on)
    c.me_max_weight = 1.0  # lambda of the mean-entropy maximisation over the global batch (0: off)
    return c


def head_keys() -> CfgNode:
    """MODEL.HEAD keys of the msn head."""
    c = CfgNode()
    c.NUM_PROTOTYPES = 1024  # msn: K learnable prototypes of width DIMS[-1] (MSN: 1024)
    return c


# ---------------------------------------------------------------------------------------- head


class MSNPrototypes(nn.Module):
    """K learnable prototypes, ``weight`` (K, D), drawn from U(-1/sqrt(D), 1/sqrt(D)) as the
    authors'. ``forward(z)``: z (N, D) -> (z, prototypes) both L2-normalised row by row, in
    float32 (float64 for float64 inputs) even under autocast: the targets' temperature 0.025
    turns a bf16 rounding of a similarity into a 30% change of its odds. Its own class: the wrap
    policy keeps it a separate full-precision unit."""

    def __init__(self, dim: int, num_prototypes: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_prototypes, dim))
        bound = dim**-0.5
        nn.init.uniform_(self.weight, -bound, bound)

    def forward(self, z: torch.Tensor):
        dtype = torch.promote_types(z.dtype, torch.float32)
        with torch.autocast(device_type="cpu" if z.is_meta else z.device.type, enabled=False):
            return F.normalize(z.to(dtype), dim=1), F.normalize(self.weight.to(dtype), dim=1)


class MSNOutput(NamedTuple):
    """The msn head's output: L2-normalised, float32."""

    embeddings: torch.Tensor  # (C N, D) the crops' projections, crop by crop
    prototypes: torch.Tensor  # (K, D) the prototypes


class MSNHead(nn.Module):
    """``forward(x)``: x (N, dims[0]) -> :class:`MSNOutput`.

    MSN: "a 3-layer projection head with output dimension 256 and batch-normalization at the
    input and hidden layers"; the authors' ``init_model``: Linear, BatchNorm, GELU, Linear,
    BatchNorm, GELU, Linear ([*, 2048, 2048, 256]), then the prototypes (:class:`MSNPrototypes`).
    The teacher's copy holds prototypes too (averaged, unused: the targets are scored by the
    student's, as the authors').
    """

    in_feature = "avgpool"

    def __init__(self, dims: Sequence[int], use_bn: bool, num_prototypes: int):
        super().__init__()
        if num_prototypes <= 0:
            raise ConfigError(f"MODEL.HEAD.NUM_PROTOTYPES must be positive, got {num_prototypes}")
        self.projection = MLP(dims, use_bn, activation="gelu")
        self.prototypes = MSNPrototypes(self.projection.dims[-1], num_prototypes)

    def forward(self, x: torch.Tensor) -> MSNOutput:
        return MSNOutput(*self.prototypes(self.projection(x)))


def build_head(head_cfg) -> MSNHead:
    return MSNHead(head_cfg.DIMS, head_cfg.USE_BN, int(head_cfg.NUM_PROTOTYPES))


# ----------------------------------------------------------------------------------- criterion


class MSNCriterion(Criterion):
    """MSN on the student's :class:`MSNOutput` of the anchor crops (crops 1 .. C-1, ((C-1) N, D))
    and the teacher's of the target crop (crop 0, (N, D)): ``msn_loss(anchors, targets,
    student prototypes)``. ``masking`` drops patches of the anchors of the first resolution."""

    def __init__(self, msn_cfg, model_cfg=None):
        super().__init__()
        self.cfg = msn_cfg
        self.teacher_momentum = float(msn_cfg.momentum_teacher)
        self.mask_ratio = float(msn_cfg.mask_ratio)
        self.patch_size = 0
        if self.mask_ratio > 0:
            if model_cfg is None:
                raise ValueError("msn_loss masks the trunk's patches: build it with build_method(cfg)")
            layout = token_layout(model_cfg.TRUNK)
            if isinstance(layout, str):
                raise ConfigError(f"LOSS.msn_loss.mask_ratio > 0 drops a ViT's patches: {layout}")
            self.patch_size = layout.patch_size
        # the run's seed (set before the criterion is built) and the rank: independent masks per rank
        self.generator = torch.Generator().manual_seed(torch.initial_seed() + 7919 * comm.get_rank())

    def student_crops(self, crops):
        return crops[1:]

    def teacher_crops(self, crops):
        return crops[:1]

    def masking(self, crops: Sequence[torch.Tensor]) -> Dict[str, torch.Tensor]:
        """``keep`` (R N, K): the patches each image of the first R anchor crops keeps, R the run
        of crops of the first crop's size (``SSLModel``'s first run; the other crops go whole)."""
        if self.mask_ratio == 0:
            return {}
        size = crops[0].shape[-2:]
        run = next((i for i, crop in enumerate(crops) if crop.shape[-2:] != size), len(crops))
        patches = (size[0] // self.patch_size) * (size[1] // self.patch_size)
        keep, _ = random_keep(run * crops[0].shape[0], patches, self.mask_ratio, self.generator)
        return {"keep": keep.to(crops[0].device)}

    def forward(self, model_output, num_crops: int, teacher_output=None) -> torch.Tensor:
        if num_crops < 2:
            raise ValueError(f"msn_loss needs a target crop and at least one anchor crop, got {num_crops}")
        if teacher_output is None:
            raise ValueError("msn_loss needs the teacher's output of the target crop")
        if not isinstance(model_output, MSNOutput):
            raise ValueError("msn_loss expects the (embeddings, prototypes) of an msn head")
        c = self.cfg
        return msn_loss(
            model_output.embeddings,
            teacher_output.embeddings,
            model_output.prototypes,
            temperature=c.temperature,
            sharpen_temperature=c.sharpen_temperature,
            sinkhorn_iterations=int(c.sinkhorn_iterations),
            me_max_weight=c.me_max_weight,
        )

    def get_extra_state(self):
        return {"generator": self.generator.get_state()}

    def set_extra_state(self, state) -> None:
        self.generator.set_state(state["generator"])


def vit_anchors(cfg) -> Optional[str]:
    """A method check: with mask_ratio > 0 the anchors drop a ViT's patches."""
    trunk = cfg.MODEL.TRUNK
    if cfg.LOSS.msn_loss.mask_ratio == 0:
        return None
    layout = token_layout(trunk)
    if isinstance(layout, str):
        return (
            f"LOSS.msn_loss.mask_ratio > 0 drops a ViT's patches: {layout} (now MODEL.TRUNK.NAME={trunk.NAME}; "
            "or set mask_ratio 0)"
        )
    return None


def collectives(cfg: CfgNode, world: int) -> List[LossCollective]:
    """me-max: the all-gather of the ranks' mean assignments (K,) and the all-reduce of their
    gradient, fp32; Sinkhorn-Knopp: its max, its mass and count, its row sums per iteration."""
    c, k = cfg.LOSS.msn_loss, cfg.MODEL.HEAD.NUM_PROTOTYPES
    out = []
    if c.me_max_weight > 0:
        out += [
            LossCollective("all_gather", world * k * 4, 1),
            LossCollective("all_reduce", world * k * 4, 1),
        ]
    if c.sinkhorn_iterations > 0:
        out += [LossCollective("all_reduce", 4, 1), LossCollective("all_reduce", 8, 1)]
        out.append(LossCollective("all_reduce", k * 4, int(c.sinkhorn_iterations)))
    return out


def loss_memory(cfg: CfgNode) -> int:
    """The teacher's target embeddings (N, D) alive across the student's forward and backward,
    and the anchors' assignments (A N, K) with their log-probabilities, fp32 (A anchor crops)."""
    crops = sum(cfg.DATA.TRAIN.TRANSFORMS.NUM_CROPS) if cfg.DATA.TRAIN.TRANSFORMS.NAME == "multicrop" else 2
    n, head = cfg.DATA.TRAIN.BATCHSIZE_PER_REPLICA, cfg.MODEL.HEAD
    return (n * head.DIMS[-1] + 2 * (crops - 1) * n * head.NUM_PROTOTYPES) * 4


HEAD = Head("msn", build_head, head_keys, fp32_units=(MSNPrototypes,))

METHOD = Method(
    name="msn_loss",
    criterion=MSNCriterion,
    head=HEAD,
    section=section,
    rules={
        "momentum_teacher": [probability],
        "mask_ratio": [at_least(0.0), below(1.0)],
        "temperature": [above(0.0)],
        "sharpen_temperature": [above(0.0)],
        "sinkhorn_iterations": [at_least(0)],
        "me_max_weight": [at_least(0.0)],
    },
    checks=(vit_anchors,),
    teacher=True,
    collectives=collectives,
    loss_memory=loss_memory,
)
