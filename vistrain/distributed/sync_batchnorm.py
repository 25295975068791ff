"""Synchronised BatchNorm that also runs on CPU (gloo), and the model conversion helpers.

``torch.nn.SyncBatchNorm`` refuses CPU tensors, so CPU multi-rank runs (and their tests) use
:class:`CPUSyncBatchNorm`: BatchNorm (Ioffe & Szegedy 2015) whose batch statistics are those of the
concatenated global batch::

    mean = sum_r S1_r / n,   var = sum_r S2_r / n - mean^2,   n = sum_r n_r
    y    = (x - mean) / sqrt(var + eps) * weight + bias

where S1_r, S2_r and n_r are rank r's per-channel sum, sum of squares and element count, reduced in
ONE all-reduce (fp32 even for bf16/fp16 inputs). The sum-of-squares form loses relative precision
~1e-7 * mean^2 / var in fp32 (torch's CUDA SyncBatchNorm merges per-rank Welford statistics
instead); normalised activations are far from that regime. It works on any device; on CUDA the
conversion picks torch's SyncBatchNorm, whose kernels are faster.
"""

import functools
import inspect
from typing import List, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

from vistrain.distributed.comm import all_reduce_sum, get_rank, get_world_size
from vistrain.torch_compat import BatchNormBase


def _stats_dtype(x: torch.Tensor) -> torch.dtype:
    # fp32 accumulation for half inputs; float64 inputs keep their precision.
    return torch.float64 if x.dtype == torch.float64 else torch.float32


class _SyncBatchNormFn(torch.autograd.Function):
    """Training-mode BatchNorm over the global batch; gradients as if the batch were concatenated.

    Forward: x (N, C, *) any float dtype -> y, same shape and dtype. Running stats are updated in
    place with the global mean and the unbiased global variance var * n / (n - 1).
    Backward (xhat = (x - mean) * invstd, sums over every element of a channel on every rank)::

        dx = weight * invstd * (dy - sum(dy) / n - xhat * sum(dy * xhat) / n)
        dweight = local sum(dy * xhat),  dbias = local sum(dy)

    The weight/bias gradients stay local (DDP or the sharded engine reduces them, as for any
    parameter); the two per-channel sums for dx are all-reduced in one call. The elementwise work
    runs in torch's native BatchNorm kernels (normalising with given statistics, and the local
    sums of the backward), and dx is one per-channel affine map of (dy, x): chains of separate
    elementwise ops took 2.2x as long per step of the ELPV recipe (dev/bench/bench_elpv_step.py).
    """

    @staticmethod
    def forward(ctx, x, weight, bias, running_mean, running_var, eps, momentum, group):
        dims = [0] + list(range(2, x.dim()))
        xf = x.to(_stats_dtype(x))
        local_count = torch.full((1,), x.numel() // x.shape[1], dtype=xf.dtype, device=x.device)
        stats = torch.cat([xf.sum(dims), (xf * xf).sum(dims), local_count])
        all_reduce_sum(stats, group)
        channels = x.shape[1]
        count = stats[-1].item()
        if count <= 1:
            raise ValueError(f"BatchNorm needs more than 1 value per channel, got {int(count)}")
        mean = stats[:channels] / count
        var = (stats[channels : 2 * channels] / count - mean * mean).clamp_(min=0)
        if running_mean is not None:
            # (1 - m) * running + m * batch, the same arithmetic as torch's BatchNorm.
            unbiased = var * (count / (count - 1))
            running_mean.mul_(1 - momentum).add_(mean.to(running_mean.dtype), alpha=momentum)
            running_var.mul_(1 - momentum).add_(unbiased.to(running_var.dtype), alpha=momentum)
        weight32 = None if weight is None else weight.to(xf.dtype)
        bias32 = None if bias is None else bias.to(xf.dtype)
        # eval-mode batch_norm: normalises with the statistics given, the global ones (torch's
        # kernels fault on an empty batch, which a rank may hold)
        y = (
            xf.clone()
            if x.numel() == 0
            else torch.batch_norm(xf, weight32, bias32, mean, var, False, 0.0, eps, False)
        )
        ctx.save_for_backward(x, weight32, mean, var)  # x in its own dtype: half stays half
        ctx.group, ctx.count, ctx.eps, ctx.has_bias = group, count, eps, bias is not None
        ctx.param_dtype = None if weight is None else weight.dtype
        return y.to(x.dtype)

    @staticmethod
    def backward(ctx, dy):
        x, weight32, mean, var = ctx.saved_tensors
        xf, dyf = x.to(mean.dtype), dy.to(mean.dtype)
        if x.numel() == 0:
            sum_dy_xhat, sum_dy = torch.zeros_like(mean), torch.zeros_like(mean)
        else:  # eval-mode backward with a unit weight: the local sums (dy * xhat, dy) in one pass
            _, sum_dy_xhat, sum_dy = torch.ops.aten.native_batch_norm_backward(
                dyf, xf, torch.ones_like(mean), mean, var, None, None, False, ctx.eps, [False, True, True]
            )
        dx = None
        if ctx.needs_input_grad[0]:
            sums = torch.cat([sum_dy, sum_dy_xhat])
            all_reduce_sum(sums, ctx.group)
            g_dy, g_dy_xhat = sums.view(2, -1) / ctx.count
            invstd = torch.rsqrt(var + ctx.eps)
            scale = invstd if weight32 is None else invstd * weight32
            # dx = scale * (dy - g_dy - (x - mean) * invstd * g_dy_xhat) = scale * dy + slope * x + offset
            slope = -scale * invstd * g_dy_xhat
            offset = -scale * g_dy - slope * mean
            shape = [1, x.shape[1]] + [1] * (x.dim() - 2)
            dx = torch.addcmul(offset.view(shape), dyf, scale.view(shape))
            dx = dx.addcmul_(xf, slope.view(shape)).to(x.dtype)
        dweight = dbias = None
        if weight32 is not None and ctx.needs_input_grad[1]:
            dweight = sum_dy_xhat.to(ctx.param_dtype)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            dbias = sum_dy.to(ctx.param_dtype)
        return dx, dweight, dbias, None, None, None, None, None


class CPUSyncBatchNorm(BatchNormBase):
    """BatchNorm over (N, C, ...) inputs whose training statistics span ``process_group``.

    Drop-in for ``nn.BatchNorm{1,2,3}d`` (same parameters, buffers and state-dict keys). Training
    mode with more than one rank in the group: statistics of the concatenated global batch (ranks
    may hold different N, even 0). Eval mode, or a single process: plain ``F.batch_norm``.
    Every rank of the group must call forward (and backward) the same number of times. Assumes the
    input requires grad on all ranks or on none (the backward all-reduce runs only then).
    """

    def __init__(
        self,
        num_features: int,
        eps: float = 1e-5,
        momentum: Optional[float] = 0.1,
        affine: bool = True,
        track_running_stats: bool = True,
        process_group=None,
        device=None,
        dtype=None,
    ):
        super().__init__(num_features, eps, momentum, affine, track_running_stats, device, dtype)
        self.process_group = process_group

    def _check_input_dim(self, input: torch.Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(f"expected input of shape (N, C, ...), got {input.dim()}D input")

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        self._check_input_dim(input)
        bn_training = self.training or (self.running_mean is None and self.running_var is None)
        if not bn_training or get_world_size(self.process_group) == 1:
            return super().forward(input)
        factor = self._update_batch_count()
        track = self.training and self.track_running_stats
        # Our arithmetic is explicit fp32: autocast must not recast it to a half dtype.
        with torch.autocast(device_type=input.device.type, enabled=False):
            return _SyncBatchNormFn.apply(
                input,
                self.weight,
                self.bias,
                self.running_mean if track else None,
                self.running_var if track else None,
                self.eps,
                factor,
                self.process_group,
            )

    def _update_batch_count(self) -> float:
        """Running-average factor, as torch's BatchNorm forward: momentum, or 1/batches seen when None."""
        if not (self.training and self.track_running_stats) or self.num_batches_tracked is None:
            return 0.0 if self.momentum is None else self.momentum
        self.num_batches_tracked.add_(1)
        if self.momentum is None:
            return 1.0 / float(self.num_batches_tracked)
        return self.momentum


class SyncedSubclass:
    """Mixed into a BatchNorm subclass of another library (timm's ``BatchNormAct2d``, which adds
    its activation): the class's own ``forward`` runs unchanged, its ``F.batch_norm`` call in
    training mode computing the global batch's statistics (:class:`_SyncBatchNormFn`). So what the
    subclass adds is kept, and its eval-mode output is exactly the unconverted module's."""

    process_group = None

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        if not self.training or get_world_size(self.process_group) == 1:
            return super().forward(input)
        with _GlobalBatchNorm(self):
            return super().forward(input)


_BATCH_NORM_ARGS = list(inspect.signature(F.batch_norm).parameters)


class _GlobalBatchNorm(TorchFunctionMode):
    """Routes a training-mode ``F.batch_norm`` on ``module``'s weight to :class:`_SyncBatchNormFn`."""

    def __init__(self, module: nn.Module):
        super().__init__()
        self.module = module

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is not F.batch_norm:
            return func(*args, **kwargs)
        call = {**dict(zip(_BATCH_NORM_ARGS, args)), **kwargs}
        if not call.get("training", False) or call.get("weight") is not self.module.weight:
            return func(*args, **kwargs)
        with torch.autocast(device_type=call["input"].device.type, enabled=False):
            return _SyncBatchNormFn.apply(
                call["input"], call.get("weight"), call.get("bias"), call.get("running_mean"),
                call.get("running_var"), call.get("eps", 1e-5), call.get("momentum", 0.1),
                self.module.process_group,
            )  # fmt: skip


@functools.cache
def _synced_class(cls: type) -> type:
    """``cls`` with :class:`SyncedSubclass` mixed in (one class per BatchNorm subclass)."""
    return type(f"Synced{cls.__name__}", (SyncedSubclass, cls), {"__module__": __name__})


PLAIN_BATCH_NORMS = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d)


def _is_synced(module: nn.Module) -> bool:
    return isinstance(module, (nn.SyncBatchNorm, CPUSyncBatchNorm, SyncedSubclass))


def _on_cuda(module: nn.Module) -> bool:
    tensors = list(module.parameters(recurse=False)) + list(module.buffers(recurse=False))
    return any(t.is_cuda for t in tensors)


def _synced_copy(bn: BatchNormBase, process_group) -> nn.Module:
    """A sync BN that shares ``bn``'s parameter and buffer objects (optimizer refs stay valid)."""
    cls = nn.SyncBatchNorm if _on_cuda(bn) else CPUSyncBatchNorm
    new = cls(bn.num_features, bn.eps, bn.momentum, bn.affine, bn.track_running_stats, process_group)
    if bn.affine:
        new.weight, new.bias = bn.weight, bn.bias
    new.running_mean, new.running_var = bn.running_mean, bn.running_var
    new.num_batches_tracked = bn.num_batches_tracked
    new.train(bn.training)
    if hasattr(bn, "qconfig"):
        new.qconfig = bn.qconfig
    return new


def convert_sync_batchnorm(module: nn.Module, process_group=None) -> nn.Module:
    """Replace every (not yet synced) batch norm in ``module`` by a synchronised one.

    Parameters on CUDA -> ``torch.nn.SyncBatchNorm``, else :class:`CPUSyncBatchNorm`. The new
    module reuses the old parameters and buffers (so requires_grad, values, device and dtype are
    kept) and copies eps, momentum, affine, track_running_stats and train/eval mode; all other
    modules are kept as they are. A subclass of another library (timm's ``BatchNormAct2d``) keeps
    its class and forward, with :class:`SyncedSubclass` mixed in. Returns ``module`` itself, or its replacement when ``module``
    is a BatchNorm.
    """
    if isinstance(module, BatchNormBase) and not _is_synced(module):
        if type(module) not in PLAIN_BATCH_NORMS:  # a subclass adding behaviour: keep it
            module.__class__ = _synced_class(type(module))
            module.process_group = process_group
            return module
        return _synced_copy(module, process_group)
    for name, child in module.named_children():
        new_child = convert_sync_batchnorm(child, process_group)
        if new_child is not child:
            setattr(module, name, new_child)
    return module


def sync_bn_group_ranks(world_size: int, group_size: int) -> List[List[int]]:
    """Ranks of each sync-BN group: 0 -> one group of all ranks; k > 0 -> consecutive k-rank groups.

    e.g. (8, 4) -> [[0, 1, 2, 3], [4, 5, 6, 7]]. Raises ValueError when world_size % k != 0.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if group_size < 0:
        raise ValueError(f"sync BN GROUP_SIZE must be 0 (all ranks) or > 0, got {group_size}")
    if group_size == 0:
        return [list(range(world_size))]
    if world_size % group_size != 0:
        raise ValueError(f"world size {world_size} is not divisible by sync BN GROUP_SIZE {group_size}")
    return [list(range(s, s + group_size)) for s in range(0, world_size, group_size)]


def sync_bn_process_group(group_size: int):
    """This rank's sync-BN process group (None = all ranks). Collective for group_size > 0.

    Every rank must call it: ``dist.new_group`` is created for every group on every rank.
    """
    groups = sync_bn_group_ranks(get_world_size(), group_size)
    if group_size == 0 or get_world_size() == 1:
        return None
    mine = None
    for ranks in groups:
        group = dist.new_group(ranks)
        if get_rank() in ranks:
            mine = group
    return mine
