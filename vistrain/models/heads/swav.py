"""SwAV head: projection MLP, L2 normalisation, prototype layers (Caron et al., 2020)."""

from typing import List, Sequence, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from vistrain.models.heads.mlp import MLP


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
            raise ValueError(f"MODEL.HEAD.NMB_PROTOTYPES needs positive sizes, got {nmb_prototypes}")
        self.projection = MLP(dims, use_bn)
        self.prototypes = nn.ModuleList(SwAVPrototypes(self.projection.dims[-1], k) for k in nmb_prototypes)

    def forward(self, x: torch.Tensor) -> Tuple[torch.Tensor, List[torch.Tensor]]:
        z = F.normalize(self.projection(x), dim=1, p=2)
        return z, [prototypes(z) for prototypes in self.prototypes]

    def normalize_prototypes(self) -> None:
        """L2-normalise every prototype row in place (no autograd)."""
        for prototypes in self.prototypes:
            prototypes.normalize_()


def build_swav_head(head_cfg) -> SwAVHead:
    return SwAVHead(head_cfg.DIMS, head_cfg.USE_BN, head_cfg.NMB_PROTOTYPES)
