"""SimSiam's loss (Chen and He, 2021), on plain tensors."""

from typing import Sequence

import torch
import torch.nn.functional as F


def negative_cosine(prediction: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """SimSiam's ``D(p, stopgrad(z)) = - mean_i p_i . z_i / (||p_i|| ||z_i||)``: ``prediction`` p
    (N, D), the predictor's output for one view; ``target`` z (N, D), the projection of the other
    view (detached: the stop-gradient). Computed in float32 (float64 for float64 inputs), with
    ``F.cosine_similarity``'s eps 1e-8, as the authors' ``nn.CosineSimilarity(dim=1)`` and lightly's
    ``NegativeCosineSimilarity``.

    Scaling: with equal N per rank the mean of the per-rank values is the single-process value on
    the concatenated batch, and DDP's average of the per-rank gradients is the single-process
    gradient (no collective: each image's term is its own)."""
    if prediction.dim() != 2 or prediction.shape != target.shape:
        raise ValueError(
            f"SimSiam's loss expects prediction and target of one shape (N, D), got "
            f"{tuple(prediction.shape)} and {tuple(target.shape)}"
        )
    with torch.autocast(device_type=prediction.device.type, enabled=False):
        dtype = torch.promote_types(prediction.dtype, torch.float32)
        p, z = prediction.to(dtype), target.detach().to(dtype)
        return -F.cosine_similarity(p, z, dim=1, eps=1e-8).mean()


def symmetric_simsiam_loss(
    predictions: Sequence[torch.Tensor], targets: Sequence[torch.Tensor]
) -> torch.Tensor:
    """SimSiam's ``L = D(p1, stopgrad(z2)) / 2 + D(p2, stopgrad(z1)) / 2``: ``predictions`` (p1, p2)
    and ``targets`` (z1, z2), each (N, D), of the two views. Its minimum is -1."""
    if len(predictions) != 2 or len(targets) != 2:
        raise ValueError(
            f"SimSiam takes two views: got {len(predictions)} predictions and {len(targets)} targets"
        )
    (p1, p2), (z1, z2) = predictions, targets
    return (negative_cosine(p1, z2) + negative_cosine(p2, z1)) / 2
