"""Gradients of flat shards: global clipping, per-original-parameter norms (LARS), and the
optimizer step inside backward.

**The step inside backward.** ``optimizer.step()`` after backward needs every shard's gradient at once: a rank holds its whole
gradient shard (as many bytes as its parameter shards) at the end of every backward. Here the
model's reductions call :meth:`OptimizerInBackward.step_shard` for each flat parameter once its
reduce-scatter has finished and been added to ``shard.grad``; the bound optimizer updates that
shard alone and the gradient is freed. A rank then holds the shard gradients of at most the unit
whose reduction just finished and the one in flight, and never the rest.

The update is the ordinary one: ``optimizer.step()`` runs with its parameter groups restricted to
the one shard (same hyperparameters, same ``optimizer.state`` entries, so checkpoints look alike
and a run may resume with the step in backward switched on or off). Element-wise optimizers
(SGD, AdamW) therefore give the same numbers; LARS computes each shard's per-original-parameter
norms with one all-reduce per shard instead of one per step, which sums in another order (a
rounding difference, not another formula).

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

from vistrain.fsdp.flat_param import FlatParamHandle, shard_slices
from vistrain.fsdp.ownership import handle_of, replaced_by


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """Norms and squared sums of tensors of ``dtype``: its own dtype, fp32 for fp16/bf16."""
    return torch.promote_types(dtype, torch.float32)


def clip_grad_norm_(
    params: List[torch.Tensor], max_norm: float, norm_type: float, group, device: torch.device
) -> torch.Tensor:
    """Scale gradients so that their global ``norm_type``-norm is at most ``max_norm``.

    total = (sum over ranks and shards of sum |g|^p)^(1/p)  (max |g| for p = inf); padding
    elements of a shard carry zero gradient, so they do not count. Same arithmetic as
    ``torch.nn.utils.clip_grad_norm_`` on the unsharded model, in the gradients' dtype (at least
    fp32). Returns the total norm.
    """
    norm_type = float(norm_type)
    grads = [p.grad for p in params if p.grad is not None]
    dtype = functools.reduce(torch.promote_types, [accumulation_dtype(g.dtype) for g in grads], torch.float32)
    if norm_type == math.inf:
        local = torch.zeros((), dtype=dtype)
        if grads:
            local = torch.stack([g.detach().abs().max().to(dtype) for g in grads]).max()
        local = local.to(device)
        dist.all_reduce(local, op=dist.ReduceOp.MAX, group=group)
        total = local
    else:
        local = sum(
            (torch.linalg.vector_norm(g.detach().to(dtype), norm_type) ** norm_type for g in grads),
            torch.zeros((), dtype=dtype),
        ).to(device)
        dist.all_reduce(local, op=dist.ReduceOp.SUM, group=group)
        total = local ** (1.0 / norm_type)
    clip_coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for g in grads:
        g.detach().mul_(clip_coef.to(g.device, g.dtype))
    return total


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
    """Squared L2 norm of each *original* parameter, per slice of each (possibly sharded) param.

    For a flat shard ``p`` of the built-in engine and a tensor ``t`` shaped like it (``p.detach()``
    or ``p.grad``): ||W_j||^2 (summed over every rank's slice of W_j) for each original W_j with a
    slice in this shard, one segment per slice. For a plain parameter: one segment, (t*t).sum().
    Slices come from rank arithmetic (``shard_slices``): nothing per element is built; all shards
    share one all-reduce per process group and dtype. Sums are in the tensors' dtype (at least fp32).
    """
    out: List[SegmentValues] = [None] * len(params)
    by_group = {}
    for i, (p, t) in enumerate(zip(params, tensors)):
        dtype = accumulation_dtype(t.dtype)  # float64 models keep float64 norms
        handle = handle_of(p)
        if handle is None:
            out[i] = SegmentValues.whole(t.detach().to(dtype).pow(2).sum(), t.numel())
            continue
        slices = shard_slices(handle.origins, handle.world_size, handle.rank)
        # one entry per origin (not per local slice): every rank all-reduces the same layout
        sums = torch.zeros(len(handle.origins), dtype=dtype, device=t.device)
        for idx, s_start, _, length in slices:
            sums[idx] = t.detach()[s_start : s_start + length].to(dtype).pow(2).sum()
        by_group.setdefault((handle.groups.shard, dtype), []).append((i, slices, sums))
    for (group, _), entries in by_group.items():
        flat = torch.cat([sums for _, _, sums in entries])
        if dist.get_world_size(group) > 1:
            dist.all_reduce(flat, group=group)
        offset = 0
        for i, slices, sums in entries:
            values = flat[offset : offset + sums.numel()][[idx for idx, *_ in slices]]
            starts, lengths = [s for _, s, _, _ in slices], [n for *_, n in slices]
            out[i] = SegmentValues(values, starts, lengths, tensors[i].numel())
            offset += sums.numel()
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
    """Runs ``optimizer`` on each flat shard of a wrapped model when its gradient is final.

    Shards the optimizer does not hold keep their gradient (nothing is dropped silently);
    shards passed to :meth:`freeze` have their gradient dropped and are not updated (SwAV's
    frozen prototypes: as when the ordinary loop sets their ``.grad`` to None before the step).
    ``stepped`` lists the handles updated in the current backward (cleared when one begins).
    """

    def __init__(self, optimizer: Optimizer, shards: List[nn.Parameter]):
        check_binds_shards(optimizer, shards)
        self.optimizer = optimizer
        self._frozen = set()
        self._group_index = {id(p): i for i, g in enumerate(optimizer.param_groups) for p in g["params"]}
        self.stepped: List[FlatParamHandle] = []

    def freeze(self, params: Iterable[nn.Parameter]) -> None:
        """Skip these shards in the following backward passes (until the next call)."""
        self._frozen = {id(p) for p in params}

    def step_shard(self, handle: FlatParamHandle) -> None:
        shard = handle.shard
        index = self._group_index.get(id(shard))
        if index is None or shard.grad is None:
            return
        if id(shard) not in self._frozen:
            groups = self.optimizer.param_groups
            self.optimizer.param_groups = [{**groups[index], "params": [shard]}]
            try:
                self.optimizer.step()
            finally:
                self.optimizer.param_groups = groups
            self.stepped.append(handle)
        shard.grad = None


def check_binds_shards(optimizer: Optimizer, shards: List[nn.Parameter]) -> None:
    """An optimizer bound in backward must hold shards of the model (``shards``), never the
    original parameters the engine replaced (it would train nothing, silently)."""
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
