"""Differentiable views of the global batch for the losses built on batch statistics (Barlow
Twins, VICReg, LeJEPA's SIGReg): each rank computes the statistic of the whole global batch.

Gradient convention of both helpers: every rank ends with the same global loss L, and the
backward of the collective sums the gradients of all ranks' copies of L, so each rank's inputs
receive ``world_size * dL/dx``. DDP divides by ``world_size`` when it averages parameter
gradients, so the averaged gradient equals the single-process gradient on the global batch
(the convention of ``SimCLRLoss``).
"""

from typing import List, Sequence

import torch

from vistrain.distributed import comm


def compute_dtype(t: torch.Tensor) -> torch.dtype:
    """float32 for fp16 / bf16 / fp32 inputs, float64 for float64 ones."""
    return torch.promote_types(t.dtype, torch.float32)


def gather_global_batch(views: Sequence[torch.Tensor], name: str, min_images: int) -> List[torch.Tensor]:
    """Every rank's rows of each view, rank-major: C tensors (N, D) of one shape -> C tensors
    (world * N, D) in the compute dtype, differentiable (all ranks hold equal N).

    Raises ValueError when the views differ in shape or the global batch has fewer than
    ``min_images`` images (the same on every rank, so no rank is left waiting in a collective).
    """
    shapes = [tuple(v.shape) for v in views]
    if views[0].dim() != 2 or len(set(shapes)) != 1:
        raise ValueError(f"{name} expects (N, D) tensors of one shape, got {shapes}")
    images = views[0].shape[0] * comm.get_world_size()
    if images < min_images:
        raise ValueError(
            f"{name} needs at least {min_images} images in the global batch for its batch "
            f"statistics, got {images} ({views[0].shape[0]} per rank on {comm.get_world_size()} ranks)"
        )
    dtype = compute_dtype(views[0])
    return [comm.all_gather_with_grad(v.to(dtype)) for v in views]


def sum_over_ranks(t: torch.Tensor) -> torch.Tensor:
    """Differentiable all-reduce sum of equally shaped tensors: sum_r t_r on every rank
    (identity in one process); its backward hands each rank the summed incoming gradient."""
    if comm.get_world_size() == 1:
        return t
    return comm.all_gather_with_grad(t.unsqueeze(0)).sum(dim=0)


class _ScaleGradient(torch.autograd.Function):
    @staticmethod
    def forward(ctx, t: torch.Tensor, factor: float) -> torch.Tensor:
        ctx.factor = factor
        return t.view_as(t)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad * ctx.factor, None


def scale_gradient(t: torch.Tensor, factor: float) -> torch.Tensor:
    """``t`` unchanged, its gradient times ``factor`` in backward (``t`` itself when factor is 1)."""
    return t if factor == 1 else _ScaleGradient.apply(t, factor)
