"""iBOT's masked-patch loss (Zhou et al., 2022) and the teacher's Sinkhorn-Knopp centring, as
DINOv2 uses them (Oquab et al., 2023), on plain tensors.

iBOT: "we perform self-distillation on masked patch tokens ... the student predicts the teacher's
output of the same, unmasked, patch": for each masked patch l of image n the cross-entropy
``H(P_t(x_nl), P_s(x~_nl))`` between the teacher's target on the unmasked image and the student's
prediction on the masked one. DINOv2 weighs each image's masked patches by 1 / (its masked count)
and averages over the images, masked or not.

Distributed semantics (each stated, each tested on 2 gloo ranks against one process):

* the loss is each rank's mean over its images; DDP and the sharded engine average the ranks'
  gradients, which is the mean over the global batch (every rank holds as many images);
* the centre is the moving average of the mean teacher logit over the *global* batch's masked
  patches: the sum and the count are all-reduced. (lightly and DINOv2 average the ranks' own
  means instead: the same when every rank masks as many patches, as in one process);
* Sinkhorn-Knopp centring spreads the global batch's rows evenly over the K prototypes (its
  sums and its row count all-reduced), as DINOv2's ``sinkhorn_knopp_teacher``.
"""

import torch
import torch.nn.functional as F
from torch import nn

from vistrain.distributed import comm
from vistrain.losses.global_batch import compute_dtype
from vistrain.losses.swav import sinkhorn_knopp

SINKHORN_ITERATIONS = 3  # DINOv2's, for the class and the patch targets


def sinkhorn_knopp_teacher(
    logits: torch.Tensor, teacher_temp: float, iterations: int = SINKHORN_ITERATIONS
) -> torch.Tensor:
    """DINOv2's alternative to the centre: targets (M, K) float32, each row summing to 1, from
    the teacher's logits (M, K) of this rank (M may differ between ranks, and be 0).

    ``Q = exp(logits / teacher_temp)^T`` (K, B) over the global batch of B rows, normalised to
    total mass 1, then ``iterations`` times: every prototype row to mass 1/K (row sums
    all-reduced), every sample column to mass 1/B; returned as ``B Q^T``. The same algorithm as
    SwAV's codes (``vistrain.losses.swav.sinkhorn_knopp`` with epsilon = the temperature).
    """
    return sinkhorn_knopp(logits, teacher_temp, iterations)


def ibot_cross_entropy(
    student_logits: torch.Tensor, targets: torch.Tensor, masks: torch.Tensor, student_temp: float
) -> torch.Tensor:
    """The masked-patch loss on this rank, float32.

    Args:
        student_logits: (M, K) the student's logits of the masked patches, in the order of
            ``masks.nonzero()`` (image by image, patch by patch).
        targets: (M, K) the teacher's target distributions of the same patches (no gradient).
        masks: (B, L) bool, True where image b's patch l is masked (M True in all); B counts
            every image of the rank, masked or not.
        student_temp: the student's temperature.

    Returns ``(1 / B) sum_b sum_{l masked in b} -targets_bl . log softmax(s_bl / student_temp)
    / max(1, masked_b)`` in float32 (float64 for float64 logits).
    """
    if masks.dim() != 2 or int(masks.sum()) != student_logits.shape[0]:
        raise ValueError(
            f"ibot: masks (B, L) must mark the {student_logits.shape[0]} patches scored, "
            f"got shape {tuple(masks.shape)} with {int(masks.sum())} masked"
        )
    dtype = compute_dtype(student_logits)
    log_probs = F.log_softmax(student_logits.to(dtype) / student_temp, dim=-1)
    loss = -torch.sum(targets.detach().to(dtype) * log_probs, dim=-1)  # (M,)
    per_image = masks.sum(dim=1, keepdim=True).clamp(min=1).to(dtype)  # (B, 1)
    weights = (1.0 / per_image).expand(masks.shape)[masks]  # (M,)
    return (loss * weights).sum() / masks.shape[0]


class IBOTPatchLoss(nn.Module):
    """iBOT's masked-patch loss with the teacher centred and sharpened, as DINOv2's ``centering``:
    ``P_t = softmax((g_t - c) / teacher_temp)``, ``c <- m c + (1 - m) mean(g_t)`` over the
    masked patches of the global batch (one all-reduce of their sum and count).

    ``forward(student_logits, teacher_logits, masks, teacher_temp)``: student and teacher
    logits (M, K) of this rank's masked patches, masks (B, L) as :func:`ibot_cross_entropy`.
    Returns the loss; the centre is then updated (the loss used the centre before the update).
    """

    def __init__(self, out_dim: int, student_temp: float = 0.1, center_momentum: float = 0.9):
        super().__init__()
        self.student_temp = student_temp
        self.center_momentum = center_momentum
        self.register_buffer("center", torch.zeros(1, out_dim))

    def forward(
        self,
        student_logits: torch.Tensor,
        teacher_logits: torch.Tensor,
        masks: torch.Tensor,
        teacher_temp: float,
    ) -> torch.Tensor:
        teacher_logits = teacher_logits.detach().to(compute_dtype(teacher_logits))
        targets = F.softmax((teacher_logits - self.center) / teacher_temp, dim=-1)
        loss = ibot_cross_entropy(student_logits, targets, masks, self.student_temp)
        self.update_center(teacher_logits)
        return loss

    @torch.no_grad()
    def update_center(self, teacher_logits: torch.Tensor) -> None:
        """``c <- m c + (1 - m) (sum of every rank's rows) / (their count)`` (collective)."""
        total = teacher_logits.sum(dim=0).to(self.center.dtype)
        stats = comm.all_reduce_sum(torch.cat([total, total.new_full((1,), teacher_logits.shape[0])]))
        mean = stats[:-1] / stats[-1].clamp(min=1.0)
        self.center.mul_(self.center_momentum).add_(mean.unsqueeze(0), alpha=1 - self.center_momentum)
