"""MSN's loss (Assran et al., 2022, "Masked Siamese Networks"), on plain tensors.

Each view is softly assigned to K learnable prototypes: ``p = softmax(z_n P_n^T / tau)`` with
z_n and P_n the L2-normalised embedding and prototypes. The target view's assignment, through
the momentum teacher and without gradient, is sharpened, ``p+ = p^(1/T) / sum p^(1/T)`` (so its
temperature is tau T: 0.1 x 0.25 = 0.025 in the paper), optionally balanced by Sinkhorn-Knopp;
each anchor view (masked) of the same image predicts it by cross-entropy ``H(p+, p)``. The
mean-entropy-maximisation regulariser ("me-max") pushes the anchors' mean prediction over the batch
towards the uniform: ``log K - H(mean p) = sum_k pbar_k log pbar_k + log K`` (0 at uniform use).

Distributed semantics (tested on 2 gloo ranks against one process on the global batch):

* the cross-entropy is each rank's mean over its anchors; DDP and the sharded engine average the
  ranks' gradients, the mean over the global batch (every rank holds as many anchors);
* me-max reads the mean prediction of the *global* batch: the ranks' means are summed with a
  differentiable all-gather (``global_batch.sum_over_ranks``), as the authors' ``AllReduce``;
  every rank adds the same regulariser, and a rank's anchors receive ``world_size`` times the
  single-process gradient (the convention of ``global_batch.py``);
* Sinkhorn-Knopp balances the targets of the global batch (``swav.sinkhorn_knopp``: its sums are
  all-reduced).
"""

import math

import torch
import torch.nn.functional as F

from vistrain.distributed import comm
from vistrain.losses.global_batch import compute_dtype, sum_over_ranks
from vistrain.losses.swav import sinkhorn_knopp


def prototype_logits(embeddings: torch.Tensor, prototypes: torch.Tensor, temperature: float) -> torch.Tensor:
    """Cosine similarities over the temperature: (N, D), (K, D) -> (N, K) ``z_n P_n^T / tau``."""
    return F.normalize(embeddings, dim=1) @ F.normalize(prototypes, dim=1).t() / temperature


@torch.no_grad()
def msn_targets(
    targets: torch.Tensor,
    prototypes: torch.Tensor,
    temperature: float,
    sharpen_temperature: float,
    sinkhorn_iterations: int = 0,
) -> torch.Tensor:
    """The target views' sharpened assignments (N, K), rows summing to 1, without gradient:
    ``softmax(z_n P_n^T / tau)^(1/T)`` renormalised, i.e. ``softmax(z_n P_n^T / (tau T))``, then
    ``sinkhorn_iterations`` of Sinkhorn-Knopp over the global batch (0: none)."""
    sharpened = F.softmax(prototype_logits(targets, prototypes, temperature) / sharpen_temperature, dim=1)
    if sinkhorn_iterations <= 0:
        return sharpened
    # Sinkhorn-Knopp of the sharpened probabilities themselves: exp(log p / 1)
    return sinkhorn_knopp(torch.log(sharpened), 1.0, sinkhorn_iterations)


def me_max(mean_probabilities: torch.Tensor) -> torch.Tensor:
    """``log K - H(pbar) = sum_k pbar_k log pbar_k + log K`` of a (K,) mean prediction (0 at the
    uniform; terms of pbar_k = 0 count 0)."""
    entropy_terms = torch.special.xlogy(mean_probabilities, mean_probabilities)
    return entropy_terms.sum() + math.log(mean_probabilities.shape[0])


def msn_loss(
    anchors: torch.Tensor,
    targets: torch.Tensor,
    prototypes: torch.Tensor,
    temperature: float = 0.1,
    sharpen_temperature: float = 0.25,
    sinkhorn_iterations: int = 0,
    me_max_weight: float = 1.0,
) -> torch.Tensor:
    """MSN's loss on this rank, float32 (float64 for float64 inputs).

    Args:
        anchors: (V N, D) the student's embeddings of V anchor views, view by view (rows
            [v N, (v + 1) N) are view v of the N images).
        targets: (N, D) the teacher's embeddings of the target view (no gradient flows into them).
        prototypes: (K, D) the learnable prototypes (normalised here).
        temperature: tau of every assignment (MSN: 0.1).
        sharpen_temperature: T of the targets' sharpening (MSN: 0.25, so the targets' temperature
            is tau T = 0.025).
        sinkhorn_iterations: Sinkhorn-Knopp iterations on the targets (0: none, MSN's default
            ViT-S/16 recipe: 3; lightly's ``MSNLoss``: 3).
        me_max_weight: lambda of the me-max regulariser (0: off; MSN: 1).

    Returns ``mean over the V N anchors of H(p+_n, p_vn) + lambda (sum_k pbar_k log pbar_k + log K)``,
    pbar the mean of the anchors' assignments over the global batch.
    """
    views, remainder = divmod(anchors.shape[0], max(targets.shape[0], 1))
    if anchors.dim() != 2 or targets.dim() != 2 or remainder or views < 1:
        raise ValueError(
            f"msn_loss expects anchors (V N, D) and targets (N, D), got {tuple(anchors.shape)} and "
            f"{tuple(targets.shape)}"
        )
    dtype = compute_dtype(anchors)
    with torch.autocast(device_type=anchors.device.type, enabled=False):
        anchors, prototypes = anchors.to(dtype), prototypes.to(dtype)
        goal = msn_targets(
            targets.to(dtype), prototypes, temperature, sharpen_temperature, sinkhorn_iterations
        )
        log_probabilities = F.log_softmax(prototype_logits(anchors, prototypes, temperature), dim=1)
        loss = -(goal.repeat(views, 1) * log_probabilities).sum(dim=1).mean()
        if me_max_weight > 0:
            loss = loss + me_max_weight * me_max(global_mean(log_probabilities.exp()))
    return loss


def global_mean(probabilities: torch.Tensor) -> torch.Tensor:
    """The (K,) mean of (M, K) rows over every rank's rows (every rank holds M), differentiable:
    each rank's mean summed over the ranks (``sum_over_ranks``), over the world size."""
    local = probabilities.mean(dim=0)
    world = comm.get_world_size()
    return local if world == 1 else sum_over_ranks(local) / world
