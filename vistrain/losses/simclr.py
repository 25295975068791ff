"""NT-Xent (SimCLR, Chen et al., 2020) with negatives from the whole global batch, for two or
more views per image (multi-crop)."""

import math
from typing import Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from vistrain.distributed import comm


class SimCLRLoss(nn.Module):
    """``loss(z_1, ..., z_C)``: C >= 2 tensors (N, D) (any float dtype), view c of this rank's N
    images -> scalar loss, computed in float32 (float64 for float64 inputs).

    Over the C * B global views (B = world * N images), anchor a = (c, i) has the positives
    P(a) = {(c', i): c' != c} (the other views of its image) and the negatives K(a) (every view of
    every other image). With s(a, k) = sim(z_a, z_k) / t and sim the cosine similarity,

        l_a = 1/|P(a)| sum_{p in P(a)} -log( exp(s(a, p)) / (exp(s(a, p)) + sum_{k in K(a)} exp(s(a, k))) )

    each positive scored against the negatives only, not against the anchor's other positives.
    With C = 2 this is the paper's l_i = -log( exp(s(i, j(i))) / sum_{k != i} exp(s(i, k)) ).

    ``num_global_crops`` = G > 0 keeps only the pairs with a global crop (crops 0..G-1):
    P(a) = {(c', i): c' != c, min(c, c') < G}, DINO's local-to-global correspondences; two
    local crops of an image (small, possibly disjoint parts of it) are then neither positives
    nor negatives of each other, and the loss is the mean of the pair terms
    -log( exp(s(a, p)) / (exp(s(a, p)) + sum_{k in K(a)} exp(s(a, k))) ) over all (anchor,
    positive) pairs (a global anchor has C - 1 positives, a local one G), as DINO averages its
    (global, other crop) terms. G = 0, or G >= C - 1 where no two local crops exist, is the form
    above.
    Two corrections of the negatives' term sum_{k in K(a)} exp(s(a, k)) (M = |K(a)| terms), both off
    by default, for data where many "negatives" share the anchor's class (ELPV: 58% of the cells
    are functional):

    * ``hardness`` = beta > 0 (Robinson et al., 2021, hard negatives): each term weighted by
      w_k = exp(beta s(a, k)) / mean_j exp(beta s(a, j)), so similar negatives count more;
    * ``false_negative_prior`` = tau+ in (0, 1) (Chuang et al., 2020, debiased contrastive
      loss): the weighted sum S becomes max((S - tau+ M exp(s(a, p))) / (1 - tau+), M exp(-1/t)),
      removing the share tau+ of the negatives expected to be positives.

    ``forward(*views, mix=(lam, partner))`` is i-Mix (Lee et al., ICLR 2021) for this loss: view 0 of
    image i holds lam_i x_i + (1 - lam_i) x_partner(i) (``mix_crops``; partner: a permutation of
    this rank's N images) and is only an anchor, never a key. Every anchor's keys are the clean
    views (c >= 1) of the global batch. A clean anchor's positives are the other clean views of its
    image; the mixed anchor a = (0, i) has the virtual label lam_i on image i and 1 - lam_i on image
    partner(i):

        l_a = sum_{m in (i, partner(i))} w_m 1/|P_m| sum_{p in P_m} -log( exp(s(a, p)) / (exp(s(a, p)) + sum_{k in K(a)} exp(s(a, k))) )

    P_m the clean views of image m, K(a) the clean views of every other image. Not combined with
    the options above.

    Every rank scores its C * N local anchors against all C * B views (gathered with
    ``all_gather_with_grad``) and returns the mean of its l_a (of its pair terms with G > 0:
    every rank holds the same number of pairs, so the convention below holds for both).

    Scaling convention: with equal N per rank, the single-process loss over the concatenated
    batch equals the mean of the per-rank losses, and each rank's backward yields, for its own
    inputs, ``world_size`` times the single-process gradient (the gather's backward sums every
    rank's contribution). DDP divides by world_size when it averages parameter gradients, so the
    averaged gradient equals the single-process gradient exactly. Works without
    ``torch.distributed`` (then it is the plain single-process loss).
    """

    def __init__(
        self,
        temperature: float,
        num_global_crops: int = 0,
        false_negative_prior: float = 0.0,
        hardness: float = 0.0,
    ):
        super().__init__()
        if temperature <= 0:
            raise ValueError(f"SimCLR temperature must be positive, got {temperature}")
        if num_global_crops < 0:
            raise ValueError(f"SimCLR num_global_crops must be >= 0, got {num_global_crops}")
        if not 0.0 <= false_negative_prior < 1.0:
            raise ValueError(f"SimCLR false_negative_prior must lie in [0, 1), got {false_negative_prior}")
        if hardness < 0:
            raise ValueError(f"SimCLR hardness must be >= 0, got {hardness}")
        self.temperature = temperature
        self.num_global_crops = num_global_crops
        self.false_negative_prior = false_negative_prior
        self.hardness = hardness

    def forward(
        self, *views: torch.Tensor, mix: Optional[Tuple[torch.Tensor, torch.Tensor]] = None
    ) -> torch.Tensor:
        shapes = [tuple(z.shape) for z in views]
        if len(views) < 2 or views[0].dim() != 2 or len(set(shapes)) != 1:
            raise ValueError(f"SimCLRLoss expects two or more (N, D) tensors of equal shape, got {shapes}")
        if mix is not None:
            self._check_mix(mix, len(views), views[0].shape[0])
        # Softmax over thousands of logits divided by a small temperature: keep it in fp32.
        with torch.autocast(device_type=views[0].device.type, enabled=False):
            dtype = torch.promote_types(views[0].dtype, torch.float32)  # fp64 inputs stay fp64
            views = [z.to(dtype) for z in views]
            return self._nt_xent(views) if mix is None else self._mixed_nt_xent(views, *mix)

    def _check_mix(self, mix, num_views: int, n: int) -> None:
        lam, partner = mix
        if num_views < 3:
            raise ValueError("i-Mix needs 3 or more views: view 0 is mixed, the others are the keys")
        if self.num_global_crops or self.false_negative_prior or self.hardness:
            raise ValueError("i-Mix is not combined with num_global_crops, false_negative_prior or hardness")
        if lam.shape != (n,) or partner.shape != (n,):
            raise ValueError(
                f"i-Mix expects lam and partner of shape ({n},), got {tuple(lam.shape)}, {tuple(partner.shape)}"
            )

    def _mixed_nt_xent(self, views, lam: torch.Tensor, partner: torch.Tensor) -> torch.Tensor:
        """The i-Mix form of the class docstring; view 0 mixed."""
        num_views, n = len(views), views[0].shape[0]
        logits = self._logits(views)
        device, block = logits.device, num_views * n
        columns = torch.arange(logits.shape[1], device=device)
        column_image = (columns // block) * n + columns % n  # global image index
        is_key = (columns % block) >= n  # clean views only
        rows = torch.arange(block, device=device)
        first = comm.get_rank() * n
        row_image = first + rows % n
        mixed_row = rows < n
        row_partner = torch.where(mixed_row, first + partner.to(device)[rows % n], row_image)
        row_lam = torch.where(
            mixed_row, lam.to(device, logits.dtype)[rows % n], torch.ones_like(logits[:, 0])
        )

        same_image = row_image[:, None] == column_image[None, :]
        same_partner = row_partner[:, None] == column_image[None, :]
        itself = torch.zeros_like(same_image)
        itself[rows, comm.get_rank() * block + rows] = True
        own, other = same_image & is_key & ~itself, same_partner & is_key & ~itself
        negatives = logits.masked_fill(~is_key | same_image | same_partner, float("-inf"))
        log_negatives = torch.logsumexp(negatives, dim=1, keepdim=True)
        weights = row_lam[:, None] * own / own.sum(1, keepdim=True)
        weights = weights + (1 - row_lam)[:, None] * other / other.sum(1, keepdim=True)
        pair_losses = torch.logaddexp(logits, log_negatives) - logits
        return (weights * pair_losses).sum(1).mean()

    def _logits(self, views) -> torch.Tensor:
        """s(a, k) of this rank's C * N anchors (view c's rows at [c*N, (c+1)*N)) against every
        rank's views, rank-major: (C*N, world*C*N)."""
        local = F.normalize(torch.cat(views), dim=1)
        return local @ comm.all_gather_with_grad(local).t() / self.temperature

    def _nt_xent(self, views) -> torch.Tensor:
        num_views, n = len(views), views[0].shape[0]
        logits = self._logits(views)
        rows = torch.arange(num_views * n, device=logits.device)
        offset = comm.get_rank() * num_views * n  # this rank's block of columns
        image = rows % n
        same_image = image[:, None] == image[None, :]  # (C*N, C*N) within this rank's block
        not_negative = torch.zeros_like(logits, dtype=torch.bool)
        not_negative[:, offset : offset + num_views * n] = same_image  # the anchor itself included
        positive = not_negative.clone()
        positive[rows, offset + rows] = False  # an anchor is not its own positive
        global_pairs = 0 < self.num_global_crops < num_views - 1
        if global_pairs:
            is_global = rows // n < self.num_global_crops
            positive[:, offset : offset + num_views * n] &= is_global[:, None] | is_global[None, :]
        negatives = logits.masked_fill(not_negative, float("-inf"))
        num_negatives = logits.shape[1] - num_views  # every view but the anchor image's own
        if global_pairs:  # rows hold G or C - 1 positives: the mean over the (anchor, positive) pairs
            log_negatives = self._log_negative_term(negatives, num_negatives, logits)
            pair_losses = (torch.logaddexp(logits, log_negatives) - logits).masked_fill(~positive, 0.0)
            return pair_losses.sum() / positive.sum()
        positives = logits[positive].view(num_views * n, num_views - 1)  # row order kept by masking
        log_negatives = self._log_negative_term(negatives, num_negatives, positives)
        return (torch.logaddexp(positives, log_negatives) - positives).mean()

    def _log_negative_term(self, negatives, num_negatives: int, positives) -> torch.Tensor:
        """log of the negatives' term of each pair's denominator: (rows, 1), or shaped like
        ``positives`` (rows, P) with a false-negative prior. ``negatives``: the logits with every
        non-negative at -inf; ``positives``: s(a, p) of the pairs."""
        beta, prior = self.hardness, self.false_negative_prior
        if beta == 0.0:
            log_sum = torch.logsumexp(negatives, dim=1, keepdim=True)
        else:  # log sum_k w_k e^{s_k} = LSE((1 + beta) s) - LSE(beta s) + log M
            log_sum = (
                torch.logsumexp((1.0 + beta) * negatives, dim=1, keepdim=True)
                - torch.logsumexp(beta * negatives, dim=1, keepdim=True)
                + math.log(num_negatives)
            )
        if prior == 0.0:
            return log_sum
        floor = math.log(num_negatives) - 1.0 / self.temperature  # M e^{-1/t}: every negative at cos -1
        log_ratio = math.log(prior * num_negatives) + positives - log_sum  # tau+ M e^{s_p} / S
        below_sum = log_ratio < 0.0
        # where the correction would remove the whole sum the floor applies; a safe operand there
        # keeps log() and its gradient finite
        safe = torch.where(below_sum, log_ratio, torch.full_like(log_ratio, -1.0))
        debiased = log_sum + torch.log(-torch.expm1(safe)) - math.log1p(-prior)
        return torch.where(below_sum, debiased, torch.full_like(debiased, floor)).clamp(min=floor)


def mix_crops(crops: torch.Tensor, alpha: float):
    """i-Mix's input mixing of one crop batch (N, ...): lam_i ~ Beta(alpha, alpha) and a random
    permutation ``partner`` of the N images -> (lam_i x_i + (1 - lam_i) x_partner(i), lam (N,),
    partner (N,)); from torch's global generator (the run seeds it, checkpoints keep it); the
    memory format of ``crops`` is kept."""
    n = crops.shape[0]
    beta = torch.distributions.Beta(torch.tensor(float(alpha)), torch.tensor(float(alpha)))
    lam = beta.sample((n,))
    partner = torch.randperm(n)
    weight = lam.to(crops.device, crops.dtype).view(n, *([1] * (crops.dim() - 1)))
    mixed = weight * crops + (1 - weight) * crops[partner.to(crops.device)]
    if crops.dim() == 4 and crops.is_contiguous(memory_format=torch.channels_last):
        mixed = mixed.contiguous(memory_format=torch.channels_last)
    return mixed, lam, partner
