"""SwAV (Caron et al., 2020): swapped prediction of Sinkhorn-Knopp codes (``vistrain/losses/swav.py``);
head "swav": projection MLP, L2 normalisation, prototype layers kept in fp32; the prototypes are
frozen for the first iterations and re-normalised after every step; an optional per-rank queue.
No teacher."""

from typing import List, Sequence, Tuple

import torch
import torch.nn.functional as F
from fvcore.common.config import CfgNode
from torch import nn

from vistrain.config.errors import ConfigError
from vistrain.config.warmups import Warmup
from vistrain.fsdp import gathered, params_of
from vistrain.losses.swav import SwAVLoss
from vistrain.methods.base import Criterion, Head, LossCollective, Method
from vistrain.models.heads.mlp import MLP


def section() -> CfgNode:
    """LOSS.swav_loss."""
    c = CfgNode()
    c.temperature = 0.1
    c.epsilon = 0.05  # entropic regularisation of Sinkhorn-Knopp
    c.sinkhorn_iterations = 3
    c.crops_for_assign = [0, 1]  # crops whose codes are targets
    c.freeze_prototypes_niters = 0  # prototypes get no update for this many iterations
    c.queue_length = 0  # per-rank feature queue length (0: no queue)
    c.start_queue_at_epoch = 0
    return c


def head_keys() -> CfgNode:
    """MODEL.HEAD keys of the swav head."""
    c = CfgNode()
    c.NMB_PROTOTYPES = [30]  # swav: prototypes per prototype layer (e.g. [3000])
    return c


# ---------------------------------------------------------------------------------------- head


class SwAVPrototypes(nn.Linear):
    """Prototype vectors c_k as rows of a bias-free Linear: scores = z C^T, (N, D) -> (N, K).

    Its own class so that a wrap policy can make it a separate full-precision unit (it is
    re-normalised after every optimizer step). The product runs in fp32 even under autocast:
    scores feed exp(score / epsilon) in Sinkhorn-Knopp, where bf16 rounding of a score near 1
    shifts a code by several percent. Output dtype: float32 (float64 for float64 inputs).
    """

    def __init__(self, dim: int, num_prototypes: int):
        super().__init__(dim, num_prototypes, bias=False)
        self.normalize_()  # unit-norm from the start: every forward sees normalised prototypes

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = torch.promote_types(x.dtype, torch.float32)  # fp32, or fp64 for fp64 inputs
        # autocast knows no meta device (shape-only runs: the memory planner); cpu is equivalent
        with torch.autocast(device_type="cpu" if x.is_meta else x.device.type, enabled=False):
            return F.linear(x.to(dtype), self.weight.to(dtype))

    @torch.no_grad()
    def normalize_(self) -> None:
        """L2-normalise every prototype (row of ``weight``) in place."""
        self.weight.copy_(F.normalize(self.weight, dim=1, p=2))


class SwAVHead(nn.Module):
    """``forward(x)``: x (N, dims[0]) -> (z, [scores_j]) with z = normalize(MLP(x)) (N, dims[-1])
    and scores_j = z C_j^T (N, K_j) in float32, one per prototype layer.

    SwAV: "we compute codes by matching features to a set of K trainable prototype vectors
    {c_1, ..., c_K}", with features and prototypes on the unit sphere.
    """

    in_feature = "avgpool"

    def __init__(self, dims: Sequence[int], use_bn: bool, nmb_prototypes: Sequence[int]):
        super().__init__()
        nmb_prototypes = [int(k) for k in nmb_prototypes]
        if not nmb_prototypes or min(nmb_prototypes) <= 0:
            raise ConfigError(f"MODEL.HEAD.NMB_PROTOTYPES needs positive sizes, got {nmb_prototypes}")
        self.projection = MLP(dims, use_bn)
        self.prototypes = nn.ModuleList(SwAVPrototypes(self.projection.dims[-1], k) for k in nmb_prototypes)

    def forward(self, x: torch.Tensor) -> Tuple[torch.Tensor, List[torch.Tensor]]:
        z = F.normalize(self.projection(x), dim=1, p=2)
        return z, [prototypes(z) for prototypes in self.prototypes]

    def normalize_prototypes(self) -> None:
        """L2-normalise every prototype row in place (no autograd)."""
        for prototypes in self.prototypes:
            prototypes.normalize_()


def build_head(head_cfg) -> SwAVHead:
    return SwAVHead(head_cfg.DIMS, head_cfg.USE_BN, head_cfg.NMB_PROTOTYPES)


# ----------------------------------------------------------------------------------- criterion


class SwAVCriterion(Criterion):
    """SwAV on ``(embedding (C*N, D), [scores (C*N, K_j)])``: rows [c*N, (c+1)*N) are crop c.

    Prototype state goes through ``vistrain.fsdp.params_of`` / ``gathered`` so it also works
    when the prototypes are sharded. After every step the normalised prototypes are copied
    (only when a queue is configured) to score queued embeddings in the next forward; until the
    first ``after_optimizer_step`` (fresh start or resume) the queue is filled but not used.
    The queue itself is per rank and part of ``state_dict()`` (``loss._extra_state``).
    """

    def __init__(self, swav_cfg, model_cfg=None):
        super().__init__()
        self.loss = SwAVLoss(
            temperature=swav_cfg.temperature,
            epsilon=swav_cfg.epsilon,
            sinkhorn_iterations=swav_cfg.sinkhorn_iterations,
            crops_for_assign=swav_cfg.crops_for_assign,
            queue_length=swav_cfg.queue_length,
            start_queue_at_epoch=swav_cfg.start_queue_at_epoch,
        )
        self.freeze_prototypes_niters = swav_cfg.freeze_prototypes_niters
        self.prototype_weights = None  # List[(K_j, D)] after the last step, for the queue

    def forward(self, model_output, num_crops: int, teacher_output=None) -> torch.Tensor:
        if not isinstance(model_output, (tuple, list)) or len(model_output) != 2:
            raise ValueError("swav_loss expects (embedding, [scores]) from a swav head")
        embedding, scores = model_output
        if embedding.shape[0] % num_crops:
            raise ValueError(f"{embedding.shape[0]} rows do not split into {num_crops} equal crops")
        per_layer = [list(s.chunk(num_crops)) for s in scores]
        embeddings = list(embedding.chunk(num_crops)) if self.loss.queue_active else None
        return self.loss(per_layer, embeddings, self.prototype_weights)

    def set_epoch(self, epoch: int) -> None:
        self.loss.set_epoch(epoch)

    def frozen_params(self, model: nn.Module, iteration: int) -> List[nn.Parameter]:
        """SwAV: "freeze the prototypes during the first epoch" (their parameters, or shards)."""
        if iteration >= self.freeze_prototypes_niters:
            return []
        return [param for module in _prototype_modules(model) for param in params_of(module)]

    def after_optimizer_step(self, model: nn.Module) -> None:
        """Project the prototypes back onto the unit sphere (and keep a copy for the queue)."""

        weights = []
        for module in _prototype_modules(model):
            with gathered(module):
                module.normalize_()
                if self.loss.queue_length > 0:
                    weights.append(module.weight.detach().clone())
        self.prototype_weights = weights or None


def _prototype_modules(model: nn.Module) -> List[nn.Module]:
    found = [m for m in model.modules() if isinstance(m, SwAVPrototypes)]
    if not found:
        raise ValueError("swav_loss needs a model with a swav head (no SwAVPrototypes module found)")
    return found


def collectives(cfg: CfgNode, world: int) -> List[LossCollective]:
    """Sinkhorn's all-reduces per assigned crop and prototype layer: a max, the total mass, the
    row sums of every iteration."""
    swav, out = cfg.LOSS.swav_loss, []
    for prototypes in cfg.MODEL.HEAD.NMB_PROTOTYPES:
        calls = len(swav.crops_for_assign)
        out.append(LossCollective("all_reduce", 4, calls))
        out.append(LossCollective("all_reduce", 8, calls))
        out.append(LossCollective("all_reduce", prototypes * 4, calls * swav.sinkhorn_iterations))
    return out


HEAD = Head("swav", build_head, head_keys, fp32_units=(SwAVPrototypes,))

METHOD = Method(
    name="swav_loss",
    criterion=SwAVCriterion,
    head=HEAD,
    section=section,
    collectives=collectives,
    warmups=(Warmup("freeze_prototypes_niters", "iterations"),),
)
