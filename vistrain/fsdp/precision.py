"""Precision: what a unit gathers, computes and reduces in, and the casts at its boundary.

:class:`Precision` is one unit's policy (FSDP2's ``MixedPrecisionPolicy``). The casts walk the
tensors inside module inputs and outputs whatever the container: tensors, tuples, namedtuples,
lists, dicts (their subclasses keep their type when they can be built from items) and dataclass
instances; anything else is a leaf left as it is.
"""

import dataclasses
from typing import Any, Callable, Iterator, Optional

import torch
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler as TorchShardedGradScaler


@dataclasses.dataclass(frozen=True)
class Precision:
    """How one unit gathers, computes and reduces.

    compute_dtype: gather the weights in it and cast floating inputs to it (fp16/bf16: mixed
        precision); the shards stay in the parameters' dtype (fp32 masters). None: the unit runs
        in its parameters' dtype, upcasts fp16/bf16 inputs and casts its outputs back to the
        incoming dtype (a full-precision island inside a mixed-precision network).
    reduce_dtype: reduce gradients in it (fp32 under fp16/bf16 compute: FairScale's
        ``fp32_reduce_scatter``); None: the compute dtype, or the parameters' own.
    autocast: False runs the unit with autocast off (BatchNorm in fp32 under AMP).
    """

    compute_dtype: Optional[torch.dtype] = None
    reduce_dtype: Optional[torch.dtype] = None
    autocast: bool = True

    @property
    def mixed(self) -> bool:
        return self.compute_dtype is not None


FULL_PRECISION = Precision()
# parameters, buffers and arithmetic in full precision, whatever autocast the caller runs under
KEEP_FP32 = Precision(autocast=False)

_LOW_PRECISION = (torch.float16, torch.bfloat16)


def cast_floating(
    obj: Any, dtype: torch.dtype, only_low_precision: bool = False, only_full_precision: bool = False
) -> Any:
    """Cast floating tensors inside ``obj`` (any container :func:`map_tensors` knows) to ``dtype``.

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


def map_tensors(obj: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """A copy of ``obj`` with every tensor ``t`` replaced by ``fn(t)``; containers rebuilt."""
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # namedtuple: positional constructor
        return type(obj)(*(map_tensors(item, fn) for item in obj))
    if isinstance(obj, (tuple, list)):
        return type(obj)(map_tensors(item, fn) for item in obj)
    if isinstance(obj, dict):
        mapped = {key: map_tensors(value, fn) for key, value in obj.items()}
        return mapped if type(obj) is dict else type(obj)(mapped)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        changes = {f.name: map_tensors(getattr(obj, f.name), fn) for f in dataclasses.fields(obj) if f.init}
        return dataclasses.replace(obj, **changes)
    return obj


def iter_tensors(obj: Any) -> Iterator[torch.Tensor]:
    """Every tensor inside ``obj``, depth first, in container order."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (tuple, list)):
        for item in obj:
            yield from iter_tensors(item)
    elif isinstance(obj, dict):
        for item in obj.values():
            yield from iter_tensors(item)
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for f in dataclasses.fields(obj):
            yield from iter_tensors(getattr(obj, f.name))
