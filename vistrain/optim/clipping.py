"""Gradient clipping of a plain, DDP or sharded model, after backward and before the step.

Two rules (``OPTIMIZER.clip_grad_norm`` > 0 picks the bound ``c``):

* the global norm (``OPTIMIZER.clip_grad_per_parameter`` False): every gradient scaled by
  ``min(1, c / (||(g_1, ..., g_P)|| + 1e-6))``, torch's ``clip_grad_norm_`` of the unsharded model
  (the engine's own ``clip_grad_norm_`` on its shards);
* each parameter's own norm (True): ``g_p`` scaled by ``min(1, c / (||g_p|| + 1e-6))``, DINO's
  ``utils.clip_gradients`` (its ``--clip_grad 3.0``). A parameter's norm is the original
  parameter's, summed over the ranks' parts under the sharded engine
  (``vistrain.fsdp.origin_sq_sums``: one all-reduce per step), so sharded equals DDP.
"""

from typing import List

import torch
from torch import nn

from vistrain.fsdp import Backend, backend_of, origin_sq_sums

EPS = 1e-6  # torch's and DINO's


def clip_gradients(model: nn.Module, max_norm: float, per_parameter: bool = False) -> None:
    """Clip ``model``'s gradients to ``max_norm``: their global norm, or each parameter's."""
    if per_parameter:
        clip_each_parameter_(list(model.parameters()), max_norm)
    elif backend_of(model) is not Backend.REPLICATED:  # sharded: the norm spans all shards
        model.clip_grad_norm_(max_norm)
    else:
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)


def clip_each_parameter_(params: List[torch.Tensor], max_norm: float) -> None:
    """DINO's ``clip_gradients``: each gradient g scaled in place by ``min(1, max_norm / (||g|| +
    1e-6))``, ||g|| the 2-norm of the original parameter's gradient (fp32 at least). Collective
    under the sharded engine: every rank calls it with the same parameters."""
    params = [p for p in params if p.grad is not None]
    for p, sq in zip(params, origin_sq_sums(params, [p.grad for p in params])):
        sq_sum = sq.values[0]
        if hasattr(sq_sum, "full_tensor"):  # a DTensor's (torch's fully_shard): a partial sum
            sq_sum = sq_sum.full_tensor()
        coef = torch.clamp(max_norm / (sq_sum.sqrt() + EPS), max=1.0)
        p.grad.detach().mul_(coef.to(p.grad.dtype))
