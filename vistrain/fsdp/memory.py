"""What a rank really holds: storage bytes of the tensors a model and its optimizer keep alive.

Counting ``numel`` hides views into larger buffers (a shard gradient that is a slice of a full
gradient keeps the whole buffer alive) and per-element side tables. Here every tensor counts
the bytes of its whole underlying storage, ``untyped_storage().nbytes()``, once per storage.
"""

import resource
from typing import Iterable, Iterator

import torch
from torch import nn

from vistrain.fsdp.fully_sharded import FullyShardedDataParallel


def storage_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Sum of ``untyped_storage().nbytes()`` over the distinct storages of ``tensors``.

    Meta tensors hold no memory; DTensors count their local shard.
    """
    seen = set()
    total = 0
    for t in tensors:
        if hasattr(t, "to_local"):
            t = t.to_local()
        if t.device.type == "meta":
            continue
        storage = t.untyped_storage()
        key = (t.device, storage.data_ptr(), storage.nbytes())
        if storage.nbytes() == 0 or key in seen:
            continue
        seen.add(key)
        total += storage.nbytes()
    return total


def held_tensors(model: nn.Module, optimizer=None) -> Iterator[torch.Tensor]:
    """Every tensor ``model`` and ``optimizer`` keep between steps.

    Parameters, their gradients, buffers, optimizer state and, for units of the sharded engine,
    what each flat-parameter handle holds (``FlatParamHandle.held_tensors``: gathered weights,
    their gradient, gradients kept for ``no_sync``) and the reductions in flight.
    """
    for p in model.parameters():
        yield p
        if p.grad is not None:
            yield p.grad
    yield from model.buffers()
    for module in model.modules():
        if isinstance(module, FullyShardedDataParallel):
            for handle in module.unit_state.handles:
                yield from handle.held_tensors()
            if module.unit_state.is_root and module.model_state is not None:
                yield from module.model_state.reductions.tensors()
    if optimizer is not None:
        for state in optimizer.state.values():
            yield from (v for v in state.values() if isinstance(v, torch.Tensor))


def peak_rss_mib() -> float:
    """Peak resident set size of this process (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def current_rss_mib() -> float:
    """Resident set size of this process now, from /proc/self/statm (pages)."""
    with open("/proc/self/statm") as f:
        pages = int(f.read().split()[1])
    return pages * resource.getpagesize() / 2**20


def reset_peak_rss() -> None:
    """Start a new peak: :func:`peak_rss_since_reset_mib` then reports the highest RSS reached after
    this call (Linux: writing 5 to /proc/self/clear_refs resets ``VmHWM``)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def peak_rss_since_reset_mib() -> float:
    """Highest resident set size (anonymous and file-backed pages) since :func:`reset_peak_rss`,
    or since the process started (``VmHWM`` of /proc/self/status)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError("/proc/self/status has no VmHWM")
