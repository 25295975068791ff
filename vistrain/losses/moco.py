"""MoCo v3's contrastive loss (Chen, Xie and He, 2021), on plain tensors, with the keys of the
whole global batch."""

from typing import Sequence

import torch
import torch.nn.functional as F

from vistrain.distributed import comm


def moco_v3_contrastive(query: torch.Tensor, key: torch.Tensor, temperature: float) -> torch.Tensor:
    """MoCo v3's ``ctr(q, k)``: InfoNCE of this rank's queries against every rank's keys.

    ``query`` (N, D): the student's predictor output q for N images; ``key`` (N, D): the momentum
    teacher's projection k of another view of the same images (a target: no gradient flows into
    it). Any float dtype; computed in float32 (float64 for float64 inputs). With q and k L2
    normalised and k_all (B, D) the keys of all ranks in rank order (B = world * N),

        ctr(q, k) = 2 tau * mean_i -log( exp(q_i . k_{rN+i} / tau) / sum_{j<B} exp(q_i . k_j / tau) )

    i.e. cross-entropy of the logits q k_all^T / tau (N, B) with the labels rN + arange(N) on rank
    r, times 2 tau as the authors' code scales it ("to make it less sensitive to tau").

    Scaling convention (SimCLRLoss's): with equal N per rank the mean of the per-rank values is
    the single-process loss over the concatenated batch, and each rank's backward gives its own
    queries ``world_size`` times the single-process gradient; DDP's average over ranks then equals
    the single-process gradient. The keys are gathered without gradient (they are targets).
    """
    if temperature <= 0:
        raise ValueError(f"MoCo v3 temperature must be positive, got {temperature}")
    if query.dim() != 2 or query.shape != key.shape:
        raise ValueError(
            f"moco_v3_contrastive expects query and key of one shape (N, D), got "
            f"{tuple(query.shape)} and {tuple(key.shape)}"
        )
    # a softmax over B logits divided by a small temperature: fp32 even under autocast
    with torch.autocast(device_type=query.device.type, enabled=False):
        dtype = torch.promote_types(query.dtype, torch.float32)
        q = F.normalize(query.to(dtype), dim=1)
        k = F.normalize(key.detach().to(dtype), dim=1)
        all_keys = comm.all_gather_no_grad(k)
        n = q.shape[0]
        labels = comm.get_rank() * n + torch.arange(n, device=q.device)
        return F.cross_entropy(q @ all_keys.t() / temperature, labels) * (2 * temperature)


def symmetric_moco_v3_loss(
    predictions: Sequence[torch.Tensor], targets: Sequence[torch.Tensor], temperature: float
) -> torch.Tensor:
    """MoCo v3's symmetrised loss ``ctr(q1, k2) + ctr(q2, k1)``: ``predictions`` (q1, q2), the
    student's predictor outputs for views 1 and 2, and ``targets`` (k1, k2), the teacher's
    projections of the same views, each (N, D)."""
    if len(predictions) != 2 or len(targets) != 2:
        raise ValueError(
            f"MoCo v3 takes two views: got {len(predictions)} predictions and {len(targets)} targets"
        )
    q1, q2 = predictions
    k1, k2 = targets
    return moco_v3_contrastive(q1, k2, temperature) + moco_v3_contrastive(q2, k1, temperature)
