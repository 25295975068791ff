"""Mixed-precision helpers: input casting, default compute dtype, a grad scaler for shards."""

from typing import Any

import torch
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler as TorchShardedGradScaler

from vistrain.fsdp.tree import iter_tensors, map_tensors

_LOW_PRECISION = (torch.float16, torch.bfloat16)


def default_compute_dtype(device: torch.device) -> torch.dtype:
    """float16 on CUDA (FairScale's default), bfloat16 on CPU where float16 kernels are few."""
    return torch.float16 if device.type == "cuda" else torch.bfloat16


def cast_floating(
    obj: Any, dtype: torch.dtype, only_low_precision: bool = False, only_full_precision: bool = False
) -> Any:
    """Cast floating tensors inside ``obj`` (any container ``tree.map_tensors`` knows) to ``dtype``.

    ``only_low_precision`` touches only fp16/bf16 tensors, ``only_full_precision`` only the others.
    """

    def cast(tensor: torch.Tensor) -> torch.Tensor:
        if not tensor.is_floating_point() or tensor.dtype == dtype:
            return tensor
        low = tensor.dtype in _LOW_PRECISION
        if (only_low_precision and not low) or (only_full_precision and low):
            return tensor
        return tensor.to(dtype)

    return map_tensors(obj, cast)


def low_precision_dtype(obj: Any):
    """The first fp16/bf16 dtype among the floating tensors in ``obj`` (None if there is none)."""
    for tensor in iter_tensors(obj):
        if tensor.dtype in _LOW_PRECISION:
            return tensor.dtype
    return None


# fp16 loss scaling for shards: each rank sees only its own gradient shards, so one rank may find
# an overflow another misses; skipping the step on some ranks only would desynchronise replicas.
# torch's public FSDP scaler max-reduces the found-inf flags over the process group (CPU and CUDA),
# which is exactly what our flat shards need: ShardedGradScaler(device, process_group=...).
ShardedGradScaler = TorchShardedGradScaler
