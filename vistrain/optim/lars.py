"""LARS: layer-wise adaptive rate scaling (You, Gitman & Ginsburg 2017), shard-aware.

"Large Batch Training of Convolutional Networks", eq. (6): the local learning rate of layer l is
``eta * ||w_l|| / (||grad L(w_l)|| + beta * ||w_l||)`` with beta the weight decay. Here "layer" is
one ORIGINAL parameter. Under the sharded engine a flat shard holds slices of several original
parameters and every original parameter is split across ranks, so the norms come from
``vistrain.fsdp.grads.origin_sq_sums``: per slice of an original parameter inside a shard, the
squared norm of that original parameter summed over shards and ranks; the trust ratio scales
the update slice by slice (nothing per element). Sharded LARS therefore equals DDP LARS.
"""

from typing import Callable, Dict, Optional

import torch
from torch.optim import Optimizer

from vistrain.fsdp import SegmentValues, origin_sq_sums


def _trust(w_norm: torch.Tensor, g_norm: torch.Tensor, eta: float, decay: float) -> torch.Tensor:
    """eta * ||w|| / (||g|| + decay * ||w||), 1 where either norm is 0 (elementwise)."""
    ratio = eta * w_norm / (g_norm + decay * w_norm)
    return torch.where((w_norm > 0) & (g_norm > 0), ratio, torch.ones_like(ratio))


class LARS(Optimizer):
    """SGD with momentum whose update is scaled per original parameter by the LARS trust ratio.

    For a parameter w with gradient g, weight decay wd, in a group without ``lars_exclude``::

        trust = eta * ||w|| / (||g|| + wd * ||w||)      (1 when ||w|| == 0 or ||g|| == 0)
        d     = trust * (g + wd * w)
        buf   = momentum * buf + d                      (buf = d at the first step)
        w    -= lr * (d + momentum * buf if nesterov else buf)

    Groups with ``lars_exclude=True`` (biases and norm parameters by default) take the same step
    with ``trust = 1``, i.e. plain SGD with weight decay. State key: ``momentum_buffer`` (as
    torch.optim.SGD, so checkpoints look alike). Params may be fp32 tensors of any shape, plain or
    flat shards; the norms are computed in one collective per step for all non-excluded params.
    """

    def __init__(
        self,
        params,
        lr: float,
        momentum: float = 0.9,
        weight_decay: float = 0.0,
        eta: float = 0.001,
        nesterov: bool = False,
        lars_exclude: bool = False,
    ):
        if lr < 0 or momentum < 0 or weight_decay < 0 or eta <= 0:
            raise ValueError(
                f"LARS needs lr >= 0, momentum >= 0, weight_decay >= 0, eta > 0; got lr={lr}, "
                f"momentum={momentum}, weight_decay={weight_decay}, eta={eta}"
            )
        if nesterov and momentum == 0:
            raise ValueError("LARS: nesterov momentum needs momentum > 0")
        defaults = dict(
            lr=lr,
            momentum=momentum,
            weight_decay=weight_decay,
            eta=eta,
            nesterov=nesterov,
            lars_exclude=lars_exclude,
        )
        super().__init__(params, defaults)

    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], float]] = None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        trust = self._trust_ratios()
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                self._update(p, group, trust.get(p))
        return loss

    def _trust_ratios(self) -> Dict[torch.Tensor, SegmentValues]:
        """{param: trust ratio per original parameter inside it} for every non-excluded param."""
        params, decays, etas = [], [], []
        for group in self.param_groups:
            if group["lars_exclude"]:
                continue
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise ValueError("LARS does not support sparse gradients")
                params.append(p)
                decays.append(group["weight_decay"])
                etas.append(group["eta"])
        if not params:
            return {}
        # One call (one all-reduce when sharded) for the weight and gradient norms together.
        tensors = [p.detach() for p in params] + [p.grad for p in params]
        sq = origin_sq_sums(params + params, tensors)
        out = {}
        for i, p in enumerate(params):
            w_sq, g_sq = sq[i], sq[len(params) + i]  # one value per original parameter inside p
            out[p] = w_sq.map(lambda w, g=g_sq.values, i=i: _trust(w.sqrt(), g.sqrt(), etas[i], decays[i]))
        return out

    def _update(self, p: torch.Tensor, group: dict, trust: Optional[SegmentValues]) -> None:
        d_p = p.grad
        if group["weight_decay"] != 0:
            d_p = d_p.add(p, alpha=group["weight_decay"])
        if trust is not None:  # per original parameter (slice by slice inside a flat shard)
            d_p = trust.mul_into(d_p.clone() if d_p is p.grad else d_p)
        momentum = group["momentum"]
        if momentum != 0:
            state = self.state[p]
            buf = state.get("momentum_buffer")
            if buf is None:
                buf = state["momentum_buffer"] = d_p.detach().clone()
            else:
                buf.mul_(momentum).add_(d_p)
            d_p = d_p.add(buf, alpha=momentum) if group["nesterov"] else buf
        p.add_(d_p, alpha=-group["lr"])
