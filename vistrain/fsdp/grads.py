"""Gradients of sharded parameters: global clipping, per-original-parameter norms (LARS), and
the optimizer step inside backward.

**The step inside backward.** ``optimizer.step()`` after backward needs every gradient at once: a
rank holds its whole gradient shard (as many bytes as its parameter shards) at the end of every
backward. Here the model's reductions call :meth:`OptimizerInBackward.step_shard` for each flat
parameter once its reduce-scatter has finished and been handed to its local parameters' ``.grad``;
the bound optimizer updates those parameters alone and their gradients are freed. A rank then
holds the gradients of at most the unit whose reduction just finished and the one in flight.

The update is the ordinary one: ``optimizer.step()`` runs with its parameter groups restricted to
the handle's local parameters (same hyperparameters, same ``optimizer.state`` entries, so
checkpoints look alike and a run may resume with the step in backward switched on or off).
Element-wise optimizers (SGD, AdamW) therefore give the same numbers; LARS computes the norms of
one handle's parameters with one all-reduce per handle instead of one per step, which sums in
another order (a rounding difference, not another formula).

What needs every gradient before any step cannot run inside backward: the global gradient norm
(``clip_grad_norm_`` refuses) and fp16 loss scaling (a step skipped on overflow). Gradient
accumulation works: under ``no_sync()`` nothing is reduced and nothing steps; the synced backward
steps.

**A backward that fails after some shards stepped** cannot be undone: their weights and optimizer
state moved, their gradients are gone, and no snapshot is kept (it would cost more memory than the
gradients the step in backward saves). The engine then refuses to go on silently: recovering from
that step raises :class:`PartialStepError` naming the units that stepped.
"""

import functools
import math
from dataclasses import dataclass
from typing import Iterable, List

import torch
import torch.distributed as dist
from torch import nn
from torch.optim import Optimizer

from vistrain.fsdp.flat_param import FlatParamHandle
from vistrain.fsdp.ownership import local_param_of, replaced_by


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """Norms and squared sums of tensors of ``dtype``: its own dtype, fp32 for fp16/bf16."""
    return torch.promote_types(dtype, torch.float32)


def clip_grad_norm_(
    params: List[torch.Tensor], max_norm: float, norm_type: float, group, device: torch.device
) -> torch.Tensor:
    """Scale gradients so that their global ``norm_type``-norm is at most ``max_norm``.

    As ``torch.nn.utils.clip_grad_norm_`` on the unsharded model: each parameter's norm, then
    the norm of those norms in the gradients' dtype (fp32 at least), clip coefficient
    max_norm / (total + 1e-6) clamped to 1. A parameter's norm is spread over the ranks' parts:
    each rank sums |g|^p of its part in float64, one all-reduce over ``group`` adds the parts
    per parameter (max |g| for p = inf), so each parameter's norm is exact before it is
    rounded to fp32 (torch's own fp32 kernel drifts on very large tensors: docs/engine.md).
    ``params`` must have the same parameters with a gradient on every rank of ``group`` (the
    engine gives empty parts empty gradients). Returns the total norm.
    """
    norm_type = float(norm_type)
    grads = [p.grad for p in params if p.grad is not None]
    dtype = functools.reduce(torch.promote_types, [accumulation_dtype(g.dtype) for g in grads], torch.float32)
    if not grads:
        return torch.zeros((), dtype=dtype, device=device)
    per_param = torch.stack([_part_norm_power(g.detach(), norm_type) for g in grads]).to(device)
    infinite = norm_type == math.inf
    dist.all_reduce(per_param, op=dist.ReduceOp.MAX if infinite else dist.ReduceOp.SUM, group=group)
    norms = per_param if infinite else per_param.pow(1.0 / norm_type)
    total = torch.linalg.vector_norm(norms.to(dtype), norm_type)
    clip_coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for g in grads:
        g.detach().mul_(clip_coef.to(g.device, g.dtype))
    return total


def _part_norm_power(grad: torch.Tensor, norm_type: float) -> torch.Tensor:
    """sum |g|^p of one part of a gradient in float64 (max |g| for p = inf; 0 when empty)."""
    if grad.numel() == 0:
        return torch.zeros((), dtype=torch.float64, device=grad.device)
    if norm_type == math.inf:
        return grad.abs().max().double()
    return torch.linalg.vector_norm(grad, norm_type, dtype=torch.float64).pow(norm_type)


@dataclass
class SegmentValues:
    """One value per original parameter inside a tensor: ``values[k]`` applies to the tensor's
    (flattened) elements ``[starts[k], starts[k] + lengths[k])``. A flat shard has a segment per
    original-parameter slice and padding elements have none; a plain parameter is one segment.
    """

    values: torch.Tensor  # (len(starts),) in the tensor's accumulation_dtype
    starts: List[int]
    lengths: List[int]
    numel: int  # elements of the tensor

    @classmethod
    def whole(cls, value: torch.Tensor, numel: int) -> "SegmentValues":
        """One value for all ``numel`` elements (a plain parameter)."""
        return cls(value.reshape(1), [0], [numel], numel)

    def covers_whole(self) -> bool:
        return len(self.starts) == 1 and self.starts[0] == 0 and self.lengths[0] == self.numel

    def map(self, fn) -> "SegmentValues":
        """``fn`` applied to the values (elementwise), same segments."""
        return SegmentValues(fn(self.values), self.starts, self.lengths, self.numel)

    def mul_into(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` (the tensor's shape; a flat shard is 1-D) with each segment scaled in place."""
        if self.covers_whole():
            return t.mul_(self.values[0].to(t.dtype))
        for k, (start, length) in enumerate(zip(self.starts, self.lengths)):
            t[start : start + length].mul_(self.values[k].to(t.dtype))
        return t

    def spread(self) -> torch.Tensor:
        """(numel,) with each segment's value on its elements and 0 on padding."""
        values = torch.cat([self.values, self.values.new_zeros(1)])
        counts = torch.tensor(self.lengths + [self.numel - sum(self.lengths)], device=values.device)
        return torch.repeat_interleave(values, counts, output_size=self.numel)


def origin_sq_sums(params: List[torch.Tensor], tensors: List[torch.Tensor]) -> List[SegmentValues]:
    """Squared L2 norm of each *original* parameter, for each (possibly sharded) param.

    For a local parameter ``p`` of the built-in engine (this rank's part of an original W) and a
    tensor ``t`` shaped like it (``p.detach()`` or ``p.grad``): ||W||^2 summed over every rank's
    part. For a plain parameter: (t*t).sum(). One segment covering the whole tensor each; all
    local parameters share one all-reduce per process group and dtype. Sums are in the tensors'
    dtype (at least fp32).
    """
    out: List[SegmentValues] = [None] * len(params)
    by_group = {}
    for i, (p, t) in enumerate(zip(params, tensors)):
        dtype = accumulation_dtype(t.dtype)  # float64 models keep float64 norms
        value = t.detach().to(dtype).pow(2).sum()
        found = local_param_of(p)
        if found is None or found[0].world_size == 1:
            out[i] = SegmentValues.whole(value, t.numel())
            continue
        by_group.setdefault((found[0].groups.shard, dtype), []).append((i, value))
    for (group, _), entries in by_group.items():
        flat = torch.stack([value for _, value in entries])
        dist.all_reduce(flat, group=group)
        for (i, _), value in zip(entries, flat):
            out[i] = SegmentValues.whole(value, tensors[i].numel())
    return out


def origin_sq_norms(params: List[torch.Tensor], tensors: List[torch.Tensor]) -> List[torch.Tensor]:
    """:func:`origin_sq_sums` laid out like each param: a tensor shaped like it whose element i
    holds ||W_j||^2 of the original W_j element i belongs to (padding: 0). Builds one tensor per
    param: LARS uses the sums directly."""
    return [s.spread().view_as(p) for p, s in zip(params, origin_sq_sums(params, tensors))]


class PartialStepError(RuntimeError):
    """A backward failed after the step in backward had updated some units: the model is partly
    updated (those units' weights and optimizer state moved, the others' did not)."""

    def __init__(self, stepped_units: List[str]):
        self.stepped_units = stepped_units
        super().__init__(
            f"FullyShardedDataParallel: the backward failed after the step in backward had updated "
            f"{len(stepped_units)} unit(s) ({', '.join(repr(u) for u in stepped_units)}); the model is "
            "partly updated: restore the weights and optimizer state from a checkpoint"
        )


class OptimizerInBackward:
    """Runs ``optimizer`` on each flat shard's local parameters of a wrapped model when their
    gradient is final.

    Parameters the optimizer does not hold keep their gradient (nothing is dropped silently);
    parameters passed to :meth:`freeze` have their gradient dropped and are not updated (SwAV's
    frozen prototypes: as when the ordinary loop sets their ``.grad`` to None before the step).
    ``stepped`` lists the handles updated in the current backward (cleared when one begins).
    """

    def __init__(self, optimizer: Optimizer, params: List[nn.Parameter]):
        check_binds_shards(optimizer, params)
        self.optimizer = optimizer
        self._frozen = set()
        self._group_index = {id(p): i for i, g in enumerate(optimizer.param_groups) for p in g["params"]}
        self.stepped: List[FlatParamHandle] = []

    def freeze(self, params: Iterable[nn.Parameter]) -> None:
        """Skip these parameters in the following backward passes (until the next call)."""
        self._frozen = {id(p) for p in params}

    def step_shard(self, handle: FlatParamHandle) -> None:
        """One ``optimizer.step()`` over the handle's local parameters that have a gradient
        (each in its own param group's settings), then their gradients are freed."""
        by_group = {}
        for param in handle.local_params:
            index = self._group_index.get(id(param))
            if index is None or param.grad is None:
                continue
            if id(param) in self._frozen:
                param.grad = None
                continue
            by_group.setdefault(index, []).append(param)
        if not by_group:
            return
        groups = self.optimizer.param_groups
        self.optimizer.param_groups = [{**groups[i], "params": params} for i, params in by_group.items()]
        try:
            self.optimizer.step()
        finally:
            self.optimizer.param_groups = groups
        for params in by_group.values():
            for param in params:
                param.grad = None
        self.stepped.append(handle)


def check_binds_shards(optimizer: Optimizer, shards: List[nn.Parameter]) -> None:
    """An optimizer bound in backward must hold local parameters of the model (``shards``),
    never the original parameters the engine replaced (it would train nothing, silently)."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    if any(replaced_by(p) is not None for p in params):
        raise ValueError(
            "apply_optimizer_in_backward: the optimizer holds parameters that FullyShardedDataParallel "
            "replaced by shards (it would train nothing): build it on model.parameters() after wrapping"
        )
    mine = {id(s) for s in shards}
    if not any(id(p) in mine for p in params):
        raise ValueError(
            "apply_optimizer_in_backward: the optimizer holds none of this model's shards (it would "
            "train nothing): build it on model.parameters() of the model you bind it to"
        )


def apply_optimizer_in_backward(model: nn.Module, optimizer: Optimizer) -> OptimizerInBackward:
    """``model.apply_optimizer_in_backward(optimizer)`` for the root unit ``model`` (see there)."""
    apply = getattr(type(model), "apply_optimizer_in_backward", None)
    if apply is None:
        raise TypeError(
            "apply_optimizer_in_backward needs the root FullyShardedDataParallel of the model "
            f"(got {type(model).__name__}): the step in backward follows the engine's reductions"
        )
    return apply(model, optimizer)
