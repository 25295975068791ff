"""SwAV: swapped prediction of codes from distributed Sinkhorn-Knopp (Caron et al., 2020)."""

from typing import Dict, List, Optional, Sequence, Union

import torch
import torch.nn.functional as F
from torch import nn

from vistrain.distributed import comm

Tensors = Sequence[torch.Tensor]


@torch.no_grad()
def sinkhorn_knopp(scores: torch.Tensor, epsilon: float, iterations: int, group=None) -> torch.Tensor:
    """Soft codes Q (N, K) for this rank's scores (N, K) (any float dtype, no gradient); float32
    (float64 for float64 scores) whatever the input dtype.

    Solves max_Q Tr(Q^T C^T Z) + epsilon H(Q) over the transportation polytope of the *global*
    batch of B samples: every prototype receives B / K samples' mass, every sample mass 1.
    Q = diag(u) exp(scores / epsilon) diag(v), with ``iterations`` alternating row (prototype)
    and column (sample) normalisations. Row sums, the total mass and B are all-reduced over
    ``group``, so N may differ between ranks (e.g. queues; 0 too); column sums are local. The exponent
    is shifted by the global max of scores / epsilon (exact: the first normalisation removes any
    global factor) so no exp overflows; sums are clamped away from zero so that underflowed
    rows or columns give zeros rather than NaN. In one process this is the plain algorithm.
    """
    if scores.dim() != 2:
        raise ValueError(f"sinkhorn_knopp expects (N, K) scores, got shape {tuple(scores.shape)}")
    with torch.autocast(device_type=scores.device.type, enabled=False):
        logits = scores.detach().to(_compute_dtype(scores)) / epsilon
        local_max = logits.max().reshape(1) if logits.numel() else logits.new_full((1,), float("-inf"))
        global_max = comm.all_reduce_max(local_max, group)  # a rank may hold no rows (iBOT's patches)
        q = torch.exp(logits - global_max).t()  # (K, N)
        stats = torch.stack([q.sum(), torch.tensor(float(q.shape[1]), device=q.device)])
        total, num_samples = comm.all_reduce_sum(stats, group)
        q /= total
        num_prototypes, tiny = q.shape[0], torch.finfo(q.dtype).tiny
        for _ in range(iterations):
            row_sums = comm.all_reduce_sum(q.sum(dim=1, keepdim=True), group)
            q /= row_sums.clamp_min(tiny) * num_prototypes  # each prototype: mass 1/K
            q /= q.sum(dim=0, keepdim=True).clamp_min(tiny) * num_samples  # each sample: 1/B
        return (q * num_samples).t()  # each sample's code sums to 1


def _compute_dtype(t: torch.Tensor) -> torch.dtype:
    return torch.promote_types(t.dtype, torch.float32)  # fp16/bf16 -> fp32; fp64 stays fp64


class SwAVLoss(nn.Module):
    """Swapped prediction: L = mean over assign crops s and other crops t of
    -sum_k q_s[k] log softmax(scores_t / temperature)[k], averaged over the N samples.

    ``forward(scores, embeddings=None, prototypes=None)`` -> scalar, computed in float32
    (float64 for float64 scores).
      scores: one prototype layer as a list over crops of (N, K) tensors, or a list of such
        lists, one per layer (the layer losses are averaged).
      embeddings: list over crops of (N, D) normalised embeddings; required while the queue is
        active (they fill it).
      prototypes: (K, D) prototype weights (a list of them for several layers) used to score
        the queued embeddings. While the queue is full and ``prototypes`` is given, codes of
        crop s come from Sinkhorn over [queue scores; batch scores] ("we store features from
        previous batches ... to increase the number of samples"); without it the queue is
        filled but not used for this call.
    Codes q_s are targets (no gradient); only crops in ``crops_for_assign`` produce codes.

    Queue: per rank, ``queue_length`` past embeddings of each assign crop, newest first, active
    from epoch ``start_queue_at_epoch`` (see :meth:`set_epoch`), used once full. It is saved in
    ``state_dict()`` (extra state). Scaling: like SimCLRLoss, the mean of the per-rank losses is
    the single-process loss over the concatenated batch, and DDP's averaging of the per-rank
    gradients (world_size times the single-process input gradients) makes them equal.
    """

    def __init__(
        self,
        temperature: float,
        epsilon: float,
        sinkhorn_iterations: int,
        crops_for_assign: Sequence[int],
        queue_length: int = 0,
        start_queue_at_epoch: int = 0,
        group=None,
    ):
        super().__init__()
        if temperature <= 0 or epsilon <= 0 or sinkhorn_iterations < 1 or queue_length < 0:
            raise ValueError(
                "SwAVLoss needs temperature > 0, epsilon > 0, sinkhorn_iterations >= 1, queue_length >= 0"
            )
        if not crops_for_assign or len(set(crops_for_assign)) != len(crops_for_assign):
            raise ValueError(f"crops_for_assign must be distinct crop indices, got {list(crops_for_assign)}")
        self.temperature, self.epsilon, self.iterations = temperature, epsilon, sinkhorn_iterations
        self.crops_for_assign = [int(c) for c in crops_for_assign]
        self.queue_length, self.start_queue_at_epoch, self.group = (
            queue_length,
            start_queue_at_epoch,
            group,
        )
        self.epoch = 0
        self.queue: Optional[torch.Tensor] = None  # (len(crops_for_assign), queue_length, D) >= fp32
        self.queue_filled = 0  # rows of the queue holding real embeddings

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    @property
    def queue_active(self) -> bool:
        return self.queue_length > 0 and self.epoch >= self.start_queue_at_epoch

    def forward(
        self,
        scores: Union[Tensors, Sequence[Tensors]],
        embeddings: Optional[Tensors] = None,
        prototypes: Union[None, torch.Tensor, Tensors] = None,
    ) -> torch.Tensor:
        layers = [list(scores)] if isinstance(scores[0], torch.Tensor) else [list(s) for s in scores]
        if isinstance(prototypes, torch.Tensor):
            prototypes = [prototypes]
        self._check(layers, embeddings, prototypes)
        use_queue = self.queue_active and self.queue_filled == self.queue_length and prototypes is not None
        with torch.autocast(device_type=layers[0][0].device.type, enabled=False):
            losses = []
            for j, crop_scores in enumerate(layers):
                extra = self._queue_scores(prototypes[j]) if use_queue else None
                losses.append(self._swapped_prediction(crop_scores, extra))
            if self.queue_active:
                self._enqueue(embeddings)
            return torch.stack(losses).mean()

    def _swapped_prediction(self, crop_scores: List[torch.Tensor], extra: Optional[List[torch.Tensor]]):
        n, num_crops = crop_scores[0].shape[0], len(crop_scores)
        dtype = _compute_dtype(crop_scores[0])
        log_probs = [F.log_softmax(s.to(dtype) / self.temperature, dim=1) for s in crop_scores]
        total = 0.0
        for i, crop in enumerate(self.crops_for_assign):
            pool = crop_scores[crop].detach().to(dtype)
            if extra is not None:  # queue rows first: the batch's codes are the last n rows
                pool = torch.cat([extra[i].to(dtype), pool])
            codes = sinkhorn_knopp(pool, self.epsilon, self.iterations, self.group)[-n:]
            others = [log_probs[t] for t in range(num_crops) if t != crop]
            total = total + sum(-(codes * lp).sum(dim=1).mean() for lp in others) / (num_crops - 1)
        return total / len(self.crops_for_assign)

    @torch.no_grad()
    def _queue_scores(self, prototypes: torch.Tensor) -> List[torch.Tensor]:
        weight = prototypes.detach().to(self.queue.device, self.queue.dtype)
        return [queued @ weight.t() for queued in self.queue]  # per assign crop: (queue_length, K)

    @torch.no_grad()
    def _enqueue(self, embeddings: Tensors) -> None:
        new = torch.stack([embeddings[c].detach() for c in self.crops_for_assign])
        new = new.to(_compute_dtype(new))
        if self.queue is None or self.queue.shape[-1] != new.shape[-1]:
            self.queue = new.new_zeros(len(self.crops_for_assign), self.queue_length, new.shape[-1])
            self.queue_filled = 0
        self.queue = torch.cat([new, self.queue], dim=1)[:, : self.queue_length]
        self.queue_filled = min(self.queue_length, self.queue_filled + new.shape[1])

    def _check(self, layers, embeddings, prototypes) -> None:
        num_crops = len(layers[0])
        if num_crops < 2 or any(len(crops) != num_crops for crops in layers):
            raise ValueError(
                f"SwAVLoss needs >= 2 crops, equally many per layer; got {[len(c) for c in layers]}"
            )
        if max(self.crops_for_assign) >= num_crops or min(self.crops_for_assign) < 0:
            raise ValueError(f"crops_for_assign {self.crops_for_assign} out of range for {num_crops} crops")
        if self.queue_active and (embeddings is None or len(embeddings) != num_crops):
            raise ValueError("the SwAV queue is active: pass the per-crop embeddings to the loss")
        if prototypes is not None and len(prototypes) != len(layers):
            raise ValueError(f"got {len(prototypes)} prototype weights for {len(layers)} score layers")

    def get_extra_state(self) -> Dict:
        return {"epoch": self.epoch, "queue": self.queue, "queue_filled": self.queue_filled}

    def set_extra_state(self, state: Dict) -> None:
        self.epoch, self.queue, self.queue_filled = (
            state["epoch"],
            state["queue"],
            state["queue_filled"],
        )
