"""LeJEPA's loss (Balestriero and LeCun, 2025): SIGReg, an Epps-Pulley test of random 1-D
projections of the embeddings against a standard Gaussian, plus the prediction (invariance) term
that pulls every view towards the mean of the global views. On plain tensors, over the global
batch."""

from typing import Optional, Tuple

import torch

from vistrain.distributed import comm
from vistrain.losses.global_batch import compute_dtype, sum_over_ranks

GOLDEN = 0x9E3779B9  # odd, 2**32 / golden ratio: well-spread multiples of the run seed


def direction_seed(seed: int, step: int) -> int:
    """The generator seed of step ``step`` of a run seeded ``seed``: ``(step + seed * 0x9E3779B9)
    mod 2**32`` (torch's CPU generator keeps only the low 32 bits of a seed). Distinct for every
    step of a run (below 2**32 steps); two runs whose seeds differ by less than 2,500 share no
    step's directions within their first million steps."""
    return (step + seed * GOLDEN) % 2**32


def slice_directions(
    num_features: int, num_slices: int, seed: int, step: int, device: torch.device, dtype: torch.dtype
) -> torch.Tensor:
    """SIGReg's random unit directions (D, M): the columns of a standard Gaussian (D, M) matrix
    drawn from a generator of ``device`` seeded with ``direction_seed(seed, step)``, each
    normalised to length 1. The same on every rank for equal ``(seed, step)`` and device kind,
    with no communication (CUDA's generator may give other numbers on another GPU model), and
    reproducible after a resume."""
    generator = torch.Generator(device=device).manual_seed(direction_seed(seed, step))
    gaussian = torch.randn(num_features, num_slices, generator=generator, device=device, dtype=dtype)
    return gaussian / gaussian.norm(dim=0)


def frequency_grid(
    knots: int, t_max: float, device: torch.device, dtype: torch.dtype
) -> Tuple[torch.Tensor, torch.Tensor]:
    """The Epps-Pulley integral's knots t (K,) = linspace(0, t_max, K) and weights (K,): the
    trapezoid rule on [-t_max, t_max] of an even integrand (twice the rule on [0, t_max]: dt at
    both ends, 2 dt inside) times the weight function w(t) = exp(-t^2 / 2)."""
    t = torch.linspace(0, t_max, knots, device=device, dtype=dtype)
    dt = t_max / (knots - 1)
    trapezoid = torch.full((knots,), 2 * dt, device=device, dtype=dtype)
    trapezoid[[0, -1]] = dt
    return t, trapezoid * torch.exp(-t.square() / 2)


def _check(global_views, local_views, sigreg_weight, num_slices, knots, t_max) -> torch.Tensor:
    """All views (V, N, D), the global ones first; ValueError on bad shapes or parameters."""
    if global_views.dim() != 3 or global_views.shape[0] < 1:
        raise ValueError(f"lejepa_loss expects global_views (Vg >= 1, N, D), got {tuple(global_views.shape)}")
    if local_views is not None and (
        local_views.dim() != 3 or local_views.shape[1:] != global_views.shape[1:]
    ):
        raise ValueError(
            f"lejepa_loss expects local_views (Vl, N, D) matching global_views {tuple(global_views.shape)}, "
            f"got {tuple(local_views.shape)}"
        )
    if not 0.0 <= sigreg_weight <= 1.0:
        raise ValueError(f"LeJEPA sigreg_weight must lie in [0, 1], got {sigreg_weight}")
    if num_slices < 1 or knots < 2 or t_max <= 0:
        raise ValueError(
            f"SIGReg needs num_slices >= 1, knots >= 2, t_max > 0, got {num_slices}, {knots}, {t_max}"
        )
    return global_views if local_views is None else torch.cat([global_views, local_views])


def lejepa_loss(
    global_views: torch.Tensor,
    local_views: Optional[torch.Tensor] = None,
    *,
    step: int,
    seed: int = 0,
    sigreg_weight: float = 0.05,
    num_slices: int = 1024,
    knots: int = 17,
    t_max: float = 3.0,
) -> torch.Tensor:
    """LeJEPA: ``lambda SIGReg(Z) + (1 - lambda) inv(Z)`` over all V = Vg + Vl views.

    ``global_views`` (Vg, N, D) and ``local_views`` (Vl, N, D) or None: this rank's projections
    of the views of N images (any float dtype; computed in float32, float64 for float64 inputs).
    With B = world * N the global batch, z_{v,b} view v of image b and a_m the M directions of
    ``slice_directions(D, M, seed, step)``:

    * SIGReg = mean_{v,m} EP_{v,m}, the Epps-Pulley statistic of the projections x_b = z_{v,b} . a_m
      against N(0, 1): EP = B int_{-t_max}^{t_max} |phi_B(t) - exp(-t^2/2)|^2 exp(-t^2/2) dt with the
      empirical characteristic function phi_B(t) = (1/B) sum_b exp(i t x_b), by the trapezoid rule
      on ``knots`` points (``frequency_grid``);
    * inv = (1/(V B D)) sum_{v,b} ||z_{v,b} - mu_b||^2 with mu_b the mean of image b's global views.

    ``step``: a counter equal on all ranks (the iteration), which with ``seed`` fixes the
    directions. Both terms are global-batch statistics (sums over images, one all-reduce of the
    V*M*K characteristic-function sums and the invariance sum): every rank returns the
    single-process loss of the concatenated batch; gradients follow
    ``vistrain.losses.global_batch``'s convention. Defaults are lightly's ``LeJEPALoss``'s (lambda
    = 0.05, M = 1024 slices, 17 knots on [0, 3]); the authors' minimal example draws M = 256.
    """
    views = _check(global_views, local_views, sigreg_weight, num_slices, knots, t_max)
    num_views, n, dim = views.shape
    with torch.autocast(device_type=views.device.type, enabled=False):
        dtype = compute_dtype(views)
        views = views.to(dtype)
        directions = slice_directions(dim, num_slices, seed, step, views.device, dtype)
        t, weights = frequency_grid(knots, t_max, views.device, dtype)
        tx = (views @ directions).unsqueeze(-1) * t  # (V, N, M, K)
        centres = views[: global_views.shape[0]].mean(dim=0)  # (N, D)
        local_sums = torch.cat(
            [tx.cos().sum(1).flatten(), tx.sin().sum(1).flatten(), (views - centres).square().sum().view(1)]
        )
        sums = sum_over_ranks(local_sums)
        images = n * comm.get_world_size()
        size = num_views * num_slices * knots
        cos_mean = sums[:size].view(num_views, num_slices, knots) / images
        sin_mean = sums[size : 2 * size].view(num_views, num_slices, knots) / images
        gaussian = torch.exp(-t.square() / 2)  # the characteristic function of N(0, 1)
        error = (cos_mean - gaussian).square() + sin_mean.square()
        sigreg = (images * (error @ weights)).mean()
        invariance = sums[-1] / (num_views * images * dim)
        return sigreg_weight * sigreg + (1 - sigreg_weight) * invariance
