"""Barlow Twins' loss (Zbontar et al., 2021), on plain tensors, over the global batch."""

import torch

from vistrain.distributed import comm
from vistrain.losses.global_batch import gather_global_batch, scale_gradient

# F.batch_norm's default: the authors standardise with BatchNorm1d(affine=False)
STANDARDISE_EPS = 1e-5


def standardise(z: torch.Tensor, eps: float = STANDARDISE_EPS) -> torch.Tensor:
    """Batch standardisation (B, D) -> (B, D): ``(z - mean) / sqrt(var + eps)`` per feature over
    the B rows, with the biased variance (BatchNorm in training mode, without affine)."""
    mean = z.mean(dim=0)
    var = z.var(dim=0, unbiased=False)
    return (z - mean) * torch.rsqrt(var + eps)


def barlow_twins_loss(
    z_a: torch.Tensor,
    z_b: torch.Tensor,
    off_diagonal_weight: float = 5e-3,
    authors_gradient_scale: bool = False,
) -> torch.Tensor:
    """Barlow Twins: "L = sum_i (1 - C_ii)^2 + lambda sum_i sum_{j != i} C_ij^2" with C (D, D)
    the cross-correlation of the two views' embeddings, each standardised along the batch:

        C = z_a_hat^T z_b_hat / B,   z_hat = (z - mean_b z) / sqrt(var_b z + 1e-5)

    ``z_a``, ``z_b`` (N, D): this rank's projections of two views of N images (any float dtype;
    computed in float32, float64 for float64 inputs). Mean, variance and C are over the global
    batch of B = world * N images, as the authors' code computes them (SyncBatchNorm, then the
    sum of the per-rank C over the global batch size): every rank returns the single-process loss
    of the concatenated batch. (lightly's ``gather_distributed=True`` is another loss: it
    standardises each rank's rows by their own statistics and averages the ranks' C.)
    ``off_diagonal_weight``: lambda, 5e-3 in the paper (for D = 8192). Needs B >= 2.

    Gradients: ``vistrain.losses.global_batch``'s convention (each rank's rows get world * dL/dx,
    so DDP's average is the single-process gradient of the global batch), or with
    ``authors_gradient_scale`` the authors' ``main.py``: it sums the ranks' C by an all_reduce
    outside autograd, so each rank's rows get dL/dx and DDP's average is 1 / world of the
    single-process gradient (the same on one rank).
    """
    if off_diagonal_weight < 0:
        raise ValueError(f"Barlow Twins off_diagonal_weight must be >= 0, got {off_diagonal_weight}")
    with torch.autocast(device_type=z_a.device.type, enabled=False):
        a, b = gather_global_batch([z_a, z_b], "barlow_twins_loss", min_images=2)
        c = standardise(a).t() @ standardise(b) / a.shape[0]
        diagonal = torch.diagonal(c)
        off_diagonal = c - torch.diag_embed(diagonal)  # exact zeros on the diagonal
        loss = (1 - diagonal).square().sum() + off_diagonal_weight * off_diagonal.square().sum()
    return scale_gradient(loss, 1 / comm.get_world_size() if authors_gradient_scale else 1)
