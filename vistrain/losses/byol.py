"""BYOL's loss (Grill et al., 2020), on plain tensors."""

import torch
import torch.nn.functional as F


def byol_loss(prediction: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """BYOL: "L = || q_bar - z_bar' ||^2 = 2 - 2 <q, z'> / (||q|| ||z'||)", averaged over the
    images. ``prediction`` (N, D): the online network's q_theta(z_theta); ``target`` (N, D): the
    target network's projection z'_xi (no gradient). Computed in float32."""
    q = F.normalize(prediction.float(), dim=-1)
    z = F.normalize(target.detach().float(), dim=-1)
    return (2 - 2 * (q * z).sum(dim=-1)).mean()


def symmetric_byol_loss(
    predictions: "tuple[torch.Tensor, torch.Tensor]", targets: "tuple[torch.Tensor, torch.Tensor]"
) -> torch.Tensor:
    """BYOL's total loss L + L~: view 1's prediction against view 2's target and vice versa."""
    return byol_loss(predictions[0], targets[1]) + byol_loss(predictions[1], targets[0])
