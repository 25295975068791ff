"""DINO's loss with centring and sharpening (Caron et al., 2021), on plain tensors."""

from typing import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from vistrain.distributed import comm


def teacher_temperature(epoch: int, warmup: float, final: float, warmup_epochs: int) -> float:
    """DINO's schedule: linear from ``warmup`` to ``final`` over ``warmup_epochs`` epochs
    (``np.linspace(warmup, final, warmup_epochs)[epoch]``), then ``final``."""
    if epoch >= warmup_epochs:
        return final
    if warmup_epochs == 1:
        return warmup
    return warmup + (final - warmup) * epoch / (warmup_epochs - 1)


def dino_cross_entropy(
    student: Sequence[torch.Tensor], targets: Sequence[torch.Tensor], student_temp: float
) -> torch.Tensor:
    """DINO's cross-entropy averaged over the (teacher crop, other student crop) pairs and the
    images: ``student`` C tensors (N, K) of logits, one per crop (the global crops first),
    ``targets`` G tensors (N, K) of the global crops' target distributions (centred and
    sharpened, or Sinkhorn-Knopp's), ``log softmax(s / student_temp)`` in float32."""
    log_probs = [F.log_softmax(s.float() / student_temp, dim=-1) for s in student]
    total, pairs = 0.0, 0
    for iq, q in enumerate(targets):
        for v, log_p in enumerate(log_probs):
            if v == iq:  # the same view: no target for itself
                continue
            total = total + torch.sum(-q * log_p, dim=-1).mean()
            pairs += 1
    if pairs == 0:
        raise ValueError("dino_loss needs at least two crops (one teacher crop and another)")
    return total / pairs


class DINOLoss(nn.Module):
    """Cross-entropy between the centred, sharpened teacher and the student over crop pairs.

    DINO: "we minimize  sum_{x in {x_1^g, x_2^g}} sum_{x' in V, x' != x} H(P_t(x), P_s(x'))" with
    ``P_s = softmax(g_s / tau_s)``, ``P_t = softmax((g_t - c) / tau_t)`` and the centre
    ``c <- m c + (1 - m) (1 / B) sum_i g_t(x_i)`` over the global batch B of teacher outputs
    (all ranks: one all-reduce). The sum is averaged over the (teacher crop, student crop) pairs
    and over the images, as the reference code does.

    ``forward(student, teacher, teacher_temp)``: ``student`` C tensors (N, K), one per crop (the
    global crops first), ``teacher`` G tensors (N, K) of the global crops. Returns the loss; the
    centre is then updated from ``teacher`` (the loss used the centre before the update).
    """

    def __init__(self, out_dim: int, student_temp: float = 0.1, center_momentum: float = 0.9):
        super().__init__()
        self.student_temp = student_temp
        self.center_momentum = center_momentum
        self.register_buffer("center", torch.zeros(1, out_dim))

    def forward(
        self, student: Sequence[torch.Tensor], teacher: Sequence[torch.Tensor], teacher_temp: float
    ) -> torch.Tensor:
        teacher = [t.detach().float() for t in teacher]
        targets = [F.softmax((t - self.center) / teacher_temp, dim=-1) for t in teacher]
        loss = dino_cross_entropy(student, targets, self.student_temp)
        self.update_center(torch.cat(teacher))
        return loss

    @torch.no_grad()
    def update_center(self, teacher_output: torch.Tensor) -> None:
        """``c <- m c + (1 - m) mean(teacher outputs of every rank)`` (collective)."""
        total = comm.all_reduce_sum(teacher_output.sum(dim=0, keepdim=True))
        count = teacher_output.shape[0] * comm.get_world_size()
        self.center.mul_(self.center_momentum).add_(total / count, alpha=1 - self.center_momentum)
