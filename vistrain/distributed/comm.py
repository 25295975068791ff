"""Collective helpers that are no-ops (or identities) in one process.

Everything here works without ``torch.distributed`` initialised, so the same code runs in a
notebook, in a single-process test and in a multi-node job.
"""

import os
from typing import List, Optional

import torch
import torch.distributed as dist


def is_dist() -> bool:
    return dist.is_available() and dist.is_initialized()


def get_world_size(group=None) -> int:
    return dist.get_world_size(group) if is_dist() else 1


def get_rank(group=None) -> int:
    return dist.get_rank(group) if is_dist() else 0


def is_main_process() -> bool:
    return get_rank() == 0


def get_local_rank() -> int:
    """Rank among the processes on this machine: ``LOCAL_RANK``, set by torchrun and by our launcher."""
    return int(os.environ.get("LOCAL_RANK", "0"))


def barrier() -> None:
    if get_world_size() > 1:
        dist.barrier()


def all_reduce_sum(tensor: torch.Tensor, group=None) -> torch.Tensor:
    """In-place sum over ranks (identity in one process). Returns ``tensor``."""
    if get_world_size(group) > 1:
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group)
    return tensor


def all_reduce_max(tensor: torch.Tensor, group=None) -> torch.Tensor:
    """In-place max over ranks (identity in one process). Returns ``tensor``."""
    if get_world_size(group) > 1:
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=group)
    return tensor


def all_gather_no_grad(tensor: torch.Tensor, group=None) -> torch.Tensor:
    """Concatenate equally shaped tensors of all ranks along dim 0: (N, ...) -> (world*N, ...)."""
    world = get_world_size(group)
    if world == 1:
        return tensor
    out = [torch.empty_like(tensor) for _ in range(world)]
    dist.all_gather(out, tensor.contiguous(), group=group)
    return torch.cat(out, dim=0)


class _GatherWithGrad(torch.autograd.Function):
    """All-gather whose backward sends every rank the gradient of its own slice.

    Each rank's loss depends on every rank's inputs, so the gradient of the *global* loss
    sum_r L_r with respect to rank r's input is the sum over ranks of dL_k/dx_r: backward
    all-reduces the incoming gradient, then keeps this rank's slice. Skipping the all-reduce
    is the classic 1/world_size gradient bug.
    """

    @staticmethod
    def forward(ctx, tensor, group):
        ctx.group = group
        ctx.rank = get_rank(group)
        ctx.batch = tensor.shape[0]
        return all_gather_no_grad(tensor, group)

    @staticmethod
    def backward(ctx, grad_output):
        grad = grad_output.contiguous().clone()
        all_reduce_sum(grad, ctx.group)
        start = ctx.rank * ctx.batch
        return grad[start : start + ctx.batch], None


def all_gather_with_grad(tensor: torch.Tensor, group=None) -> torch.Tensor:
    """Differentiable all-gather along dim 0: (N, ...) -> (world*N, ...). Identity in one process.

    Assumes every rank contributes the same N. Gradients reach the rank that owns each slice.
    """
    if get_world_size(group) == 1:
        return tensor
    return _GatherWithGrad.apply(tensor, group)


def all_gather_object(obj) -> list:
    """List of every rank's picklable ``obj`` (``[obj]`` in one process)."""
    if get_world_size() == 1:
        return [obj]
    out: List[Optional[object]] = [None] * get_world_size()
    dist.all_gather_object(out, obj)
    return out
