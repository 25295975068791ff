"""NT-Xent (SimCLR, Chen et al., 2020) with negatives from the whole global batch."""

import torch
import torch.nn.functional as F
from torch import nn

from vistrain.distributed import comm


class SimCLRLoss(nn.Module):
    """``loss(z1, z2)``: z1, z2 (N, D) embeddings (any float dtype) of two views of this rank's N
    images -> scalar loss, computed in float32 (float64 for float64 inputs).

    For anchor i with positive j(i) (its other view), over the 2B = 2 * world * N global views:

        l_i = -log( exp(sim(z_i, z_j(i)) / t) / sum_{k != i} exp(sim(z_i, z_k) / t) )

    with sim the cosine similarity. Every rank scores its 2N local anchors against all 2B views
    (gathered with ``all_gather_with_grad``) and returns the mean of its l_i.

    Scaling convention: with equal N per rank, the single-process loss over the concatenated
    batch equals the mean of the per-rank losses, and each rank's backward yields, for its own
    inputs, ``world_size`` times the single-process gradient (the gather's backward sums every
    rank's contribution). DDP divides by world_size when it averages parameter gradients, so the
    averaged gradient equals the single-process gradient exactly. Works without
    ``torch.distributed`` (then it is the plain single-process loss).
    """

    def __init__(self, temperature: float):
        super().__init__()
        if temperature <= 0:
            raise ValueError(f"SimCLR temperature must be positive, got {temperature}")
        self.temperature = temperature

    def forward(self, z1: torch.Tensor, z2: torch.Tensor) -> torch.Tensor:
        if z1.dim() != 2 or z1.shape != z2.shape:
            shapes = f"{tuple(z1.shape)} and {tuple(z2.shape)}"
            raise ValueError(f"SimCLRLoss expects two (N, D) tensors of equal shape, got {shapes}")
        # Softmax over thousands of logits divided by a small temperature: keep it in fp32.
        with torch.autocast(device_type=z1.device.type, enabled=False):
            dtype = torch.promote_types(z1.dtype, torch.float32)  # fp64 inputs stay fp64
            return self._nt_xent(z1.to(dtype), z2.to(dtype))

    def _nt_xent(self, z1: torch.Tensor, z2: torch.Tensor) -> torch.Tensor:
        n = z1.shape[0]
        local = F.normalize(torch.cat([z1, z2]), dim=1)  # (2N, D): view 1 rows, then view 2 rows
        everyone = comm.all_gather_with_grad(local)  # (world*2N, D), rank-major
        logits = local @ everyone.t() / self.temperature  # (2N, world*2N)

        rows = torch.arange(2 * n, device=local.device)
        offset = comm.get_rank() * 2 * n  # this rank's block of columns
        self_mask = torch.zeros_like(logits, dtype=torch.bool)
        self_mask[rows, offset + rows] = True
        logits = logits.masked_fill(self_mask, float("-inf"))  # an anchor is not its own negative
        positives = offset + (rows + n) % (2 * n)  # view 1 row i <-> view 2 row i
        return F.cross_entropy(logits, positives)
