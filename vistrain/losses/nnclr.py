"""NNCLR (Dwibedi et al., 2021): NT-Xent where each anchor's positive is the nearest neighbour of its
projection in a support set, a queue of the global batch's past projections."""

from typing import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from vistrain.distributed import comm
from vistrain.losses.simclr import SimCLRLoss


class SupportSet(nn.Module):
    """NNCLR's support set Q: the ``size`` (rows) latest L2-normalised projections of the global
    batch, a first-in first-out ring of float32 rows (``queue`` (size, dim), ``position`` the next
    row to write), starting as random unit vectors (as lightly's ``NNMemoryBankModule`` and
    solo-learn's queue) drawn from ``seed`` (the run's: every rank draws the same rows).

    The queue is global: :meth:`push` all-gathers the projections of every rank (rank-major, the
    global batch's order), so every rank holds the same queue, equal to one process's on the global
    batch; it is in ``state_dict()`` and comes back whole on any world size (rank 0's copy).
    Holding it whole costs size x dim x 4 bytes per rank and the lookup needs no collective: a
    queue split by rows across ranks would need every rank's queries and candidates gathered at
    each lookup.
    """

    def __init__(self, size: int, dim: int, seed: int = 0):
        super().__init__()
        if size < 1 or dim < 1:
            raise ValueError(f"NNCLR's support set needs size >= 1 and dim >= 1, got {size} and {dim}")
        generator = torch.Generator().manual_seed(seed)
        self.register_buffer("queue", F.normalize(torch.randn(size, dim, generator=generator), dim=1))
        self.register_buffer("position", torch.zeros((), dtype=torch.long))

    @torch.no_grad()
    def nearest(self, z: torch.Tensor) -> torch.Tensor:
        """NN(z, Q) = argmax_{q in Q} cos(z_i, q) for each row of ``z`` (N, dim): (N, dim) unit rows
        of the queue, float32 (no gradient: the support set is not trained through)."""
        with torch.autocast(device_type=z.device.type, enabled=False):
            query = F.normalize(z.detach().to(self.queue.dtype), dim=1)
            return self.queue[(query @ self.queue.t()).argmax(dim=1)]

    @torch.no_grad()
    def push(self, z: torch.Tensor) -> None:
        """Collective: append every rank's ``z`` (N, dim), normalised, dropping the oldest rows (with
        a global batch of ``size`` or more rows, its last ``size`` rows are the queue)."""
        rows = comm.all_gather_no_grad(F.normalize(z.detach().to(self.queue.dtype), dim=1))
        size = self.queue.shape[0]
        if rows.shape[0] >= size:
            self.queue.copy_(rows[-size:])
            self.position.zero_()
            return
        start = int(self.position)
        slots = (start + torch.arange(rows.shape[0], device=self.queue.device)) % size
        self.queue[slots] = rows
        self.position.fill_((start + rows.shape[0]) % size)


def nnclr_loss(
    projections: Sequence[torch.Tensor],
    predictions: Sequence[torch.Tensor],
    support: SupportSet,
    contrast: SimCLRLoss,
) -> torch.Tensor:
    """NNCLR's symmetrised loss ``(NT-Xent(NN(z0), p1) + NT-Xent(NN(z1), p0)) / 2``, then the second
    view's projections z1 pushed into the support set (collective), as lightly's NNCLR: its
    ``NNMemoryBankModule`` (z0 looked up, z1 looked up and enqueued) and ``NTXentLoss``.

    ``projections`` (z0, z1) and ``predictions`` (p0, p1): each (N, D), the two views' projector
    and predictor outputs. ``contrast``: NT-Xent over the global batch (``SimCLRLoss`` with 2 views:
    anchor NN(z0_i) has the positive p1_i and the negatives every other NN(z0_j) and p1_j of all
    ranks, and p1_i anchors the same way: lightly's ``NTXentLoss(gather_distributed=True)``).
    The neighbours come from the support set as it was before this step's push. The paper's eq. 2
    scores NN(z0_i) against the batch's p1_j only (no negatives from its own view); lightly's form
    (2B - 2 negatives per anchor, B the global batch) is the one implemented. Gradients flow
    through the predictions only; the scaling convention is ``SimCLRLoss``'s.
    """
    if len(projections) != 2 or len(predictions) != 2:
        raise ValueError(
            f"NNCLR takes two views: got {len(projections)} projections and {len(predictions)} predictions"
        )
    (z0, z1), (p0, p1) = projections, predictions
    nn0, nn1 = support.nearest(z0), support.nearest(z1)
    loss = (contrast(nn0, p1) + contrast(nn1, p0)) / 2
    support.push(z1)
    return loss
