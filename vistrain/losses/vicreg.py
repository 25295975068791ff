"""VICReg's loss (Bardes, Ponce and LeCun, 2022), on plain tensors, over the global batch."""

import torch
import torch.nn.functional as F

from vistrain.losses.global_batch import gather_global_batch


def variance_term(z: torch.Tensor, gamma: float, eps: float) -> torch.Tensor:
    """VICReg's v(Z) = (1/d) sum_j max(0, gamma - S(z^j, eps)), S(x, eps) = sqrt(Var(x) + eps),
    with the unbiased variance over the B rows of ``z`` (B, D)."""
    std = torch.sqrt(z.var(dim=0, unbiased=True) + eps)
    return F.relu(gamma - std).mean()


def covariance_term(z: torch.Tensor) -> torch.Tensor:
    """VICReg's c(Z) = (1/d) sum_{i != j} C(Z)_ij^2 with C(Z) = (1/(B-1)) sum_k (z_k - z_bar)(z_k -
    z_bar)^T (D, D), for ``z`` (B, D)."""
    centred = z - z.mean(dim=0)
    cov = centred.t() @ centred / (z.shape[0] - 1)
    off_diagonal = cov - torch.diag_embed(torch.diagonal(cov))
    return off_diagonal.square().sum() / z.shape[1]


def vicreg_loss(
    z_a: torch.Tensor,
    z_b: torch.Tensor,
    invariance_weight: float = 25.0,
    variance_weight: float = 25.0,
    covariance_weight: float = 1.0,
    gamma: float = 1.0,
    eps: float = 1e-4,
) -> torch.Tensor:
    """VICReg: ``lambda s(Z, Z') + mu (v(Z) + v(Z')) / 2 + nu (c(Z) + c(Z'))`` with the invariance
    s(Z, Z') = (1/(B d)) sum_b ||z_b - z'_b||^2 (the mean squared error), and v, c as in
    ``variance_term`` / ``covariance_term``. The paper writes mu [v(Z) + v(Z')]; the authors' code
    (and lightly) halve it, and so does this function, so the weights 25 / 25 / 1 mean what they
    mean there.

    ``z_a``, ``z_b`` (N, D): this rank's expander outputs for two views of N images (any float
    dtype; computed in float32, float64 for float64 inputs). All three terms are over the global
    batch of B = world * N images: every rank returns the single-process loss of the
    concatenated batch; gradients follow ``vistrain.losses.global_batch``'s convention. Needs
    B >= 2 (the unbiased variance).
    """
    for name, weight in (("invariance", invariance_weight), ("variance", variance_weight)):
        if weight < 0:
            raise ValueError(f"VICReg {name}_weight must be >= 0, got {weight}")
    if covariance_weight < 0 or eps <= 0:
        raise ValueError(f"VICReg needs covariance_weight >= 0 and eps > 0, got {covariance_weight}, {eps}")
    with torch.autocast(device_type=z_a.device.type, enabled=False):
        a, b = gather_global_batch([z_a, z_b], "vicreg_loss", min_images=2)
        invariance = F.mse_loss(a, b)
        variance = (variance_term(a, gamma, eps) + variance_term(b, gamma, eps)) / 2
        covariance = covariance_term(a) + covariance_term(b)
        return invariance_weight * invariance + variance_weight * variance + covariance_weight * covariance
