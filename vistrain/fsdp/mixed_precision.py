"""Mixed-precision helpers: input casting, default compute dtype, a grad scaler for shards."""

from typing import Any

import torch
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler as TorchShardedGradScaler

_LOW_PRECISION = (torch.float16, torch.bfloat16)


def default_compute_dtype(device: torch.device) -> torch.dtype:
    """float16 on CUDA (FairScale's default), bfloat16 on CPU where float16 kernels are few."""
    return torch.float16 if device.type == "cuda" else torch.bfloat16


def cast_floating(
    obj: Any, dtype: torch.dtype, only_low_precision: bool = False, only_full_precision: bool = False
) -> Any:
    """Cast floating tensors inside nested tuples/lists/dicts to ``dtype``.

    ``only_low_precision`` touches only fp16/bf16 tensors, ``only_full_precision`` only the others.
    """
    if isinstance(obj, torch.Tensor):
        if not obj.is_floating_point() or obj.dtype == dtype:
            return obj
        low = obj.dtype in _LOW_PRECISION
        if (only_low_precision and not low) or (only_full_precision and low):
            return obj
        return obj.to(dtype)
    if isinstance(obj, (tuple, list)):
        return type(obj)(cast_floating(o, dtype, only_low_precision, only_full_precision) for o in obj)
    if isinstance(obj, dict):
        return {k: cast_floating(v, dtype, only_low_precision, only_full_precision) for k, v in obj.items()}
    return obj


def low_precision_dtype(obj: Any):
    """The first fp16/bf16 dtype among the floating tensors in ``obj`` (None if there is none)."""
    if isinstance(obj, torch.Tensor):
        return obj.dtype if obj.dtype in _LOW_PRECISION else None
    items = obj.values() if isinstance(obj, dict) else obj if isinstance(obj, (tuple, list)) else ()
    for item in items:
        found = low_precision_dtype(item)
        if found is not None:
            return found
    return None


# fp16 loss scaling for shards: each rank sees only its own gradient shards, so one rank may find
# an overflow another misses; skipping the step on some ranks only would desynchronise replicas.
# torch's public FSDP scaler max-reduces the found-inf flags over the process group (CPU and CUDA),
# which is exactly what our flat shards need: ShardedGradScaler(device, process_group=...).
ShardedGradScaler = TorchShardedGradScaler
