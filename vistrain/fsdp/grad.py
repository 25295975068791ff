"""Gradient norms over sharded parameters: global clipping and per-original-parameter norms (LARS)."""

import math
from typing import List

import torch
import torch.distributed as dist

from vistrain.fsdp.flat_param import shard_slices


def clip_grad_norm_(
    params: List[torch.Tensor], max_norm: float, norm_type: float, group, device: torch.device
) -> torch.Tensor:
    """Scale gradients so that their global ``norm_type``-norm is at most ``max_norm``.

    total = (sum over ranks and shards of sum |g|^p)^(1/p)  (max |g| for p = inf); padding
    elements of a shard carry zero gradient, so they do not count. Same arithmetic as
    ``torch.nn.utils.clip_grad_norm_`` on the unsharded model. Returns the total norm (fp32).
    """
    norm_type = float(norm_type)
    grads = [p.grad for p in params if p.grad is not None]
    if norm_type == math.inf:
        local = (
            torch.stack([g.detach().abs().max().float() for g in grads]).max() if grads else torch.zeros(())
        )
        local = local.to(device)
        dist.all_reduce(local, op=dist.ReduceOp.MAX, group=group)
        total = local
    else:
        local = sum(
            (torch.linalg.vector_norm(g.detach().float(), norm_type) ** norm_type for g in grads),
            torch.zeros(()),
        ).to(device)
        dist.all_reduce(local, op=dist.ReduceOp.SUM, group=group)
        total = local ** (1.0 / norm_type)
    clip_coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for g in grads:
        g.detach().mul_(clip_coef.to(g.device, g.dtype))
    return total


def origin_sq_norms(params: List[torch.Tensor], tensors: List[torch.Tensor]) -> List[torch.Tensor]:
    """Squared L2 norm of each *original* parameter, laid out like each (possibly sharded) param.

    For a shard ``p`` (it carries ``p._fsdp_handle``) and a tensor ``t`` shaped like it
    (``p.detach()`` or ``p.grad``), returns a tensor shaped like ``p`` whose element i holds
    ||W_j||^2 for the original parameter W_j that element i belongs to, summed over every rank's
    slice of W_j (padding elements get 0). For a plain parameter it returns the scalar (t*t).sum().
    The slices come from rank arithmetic (``shard_slices``), so nothing per element is kept
    between steps; all shards share one all-reduce per process group.
    """
    out: List[torch.Tensor] = [None] * len(params)  # type: ignore[list-item]
    by_group = {}
    for i, (p, t) in enumerate(zip(params, tensors)):
        handle = getattr(p, "_fsdp_handle", None)
        if handle is None:
            out[i] = t.detach().float().pow(2).sum()
            continue
        slices = shard_slices(handle.origins, handle.world_size, handle.rank)
        sums = torch.zeros(len(handle.origins), dtype=torch.float32, device=t.device)
        for idx, s_start, _, length in slices:
            sums[idx] = t.detach()[s_start : s_start + length].float().pow(2).sum()
        by_group.setdefault(handle.group, []).append((i, slices, sums))
    for group, entries in by_group.items():
        flat = torch.cat([sums for _, _, sums in entries])
        if dist.get_world_size(group) > 1:
            dist.all_reduce(flat, group=group)
        offset = 0
        for i, slices, sums in entries:
            out[i] = _spread(flat[offset : offset + sums.numel()], slices, tensors[i].numel())
            offset += sums.numel()
    return out


def _spread(per_origin: torch.Tensor, slices, shard_numel: int) -> torch.Tensor:
    """(shard_numel,) fp32: per_origin[j] on the elements of origin j's slice, 0 on padding."""
    values = [per_origin[idx].reshape(1) for idx, *_ in slices]
    lengths = [length for *_, length in slices]
    padding = shard_numel - sum(lengths)
    values.append(per_origin.new_zeros(1))
    lengths.append(padding)
    counts = torch.tensor(lengths, device=per_origin.device)
    return torch.repeat_interleave(torch.cat(values), counts, output_size=shard_numel)
