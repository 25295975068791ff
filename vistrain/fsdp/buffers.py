"""DDP's ``broadcast_buffers``: every rank starts each training forward from rank 0's buffers.

Without synchronised BatchNorm each rank updates its running statistics from its own batch, so
``state_dict()`` and evaluation would depend on the rank. DDP copies the first rank's buffers to
every rank before each training forward; the root unit does the same for every unit's buffers.
"""

import datetime
from typing import List

import torch
import torch.distributed as dist

from vistrain.fsdp.ownership import owned_modules
from vistrain.fsdp.timeouts import wait_within


def model_buffers(wrapped_modules) -> List[torch.Tensor]:
    """Every buffer of the modules the units wrap (not inside nested units), each once, in a
    fixed order."""
    seen, out = set(), []
    for module in wrapped_modules:
        for sub in owned_modules(module):
            for _, buf in sub.named_buffers(recurse=False):
                if id(buf) not in seen:
                    seen.add(id(buf))
                    out.append(buf)
    return out


def broadcast_buffers(wrapped_modules, group, timeout: datetime.timedelta) -> None:
    """Copy the group's first rank's buffers to every rank: one broadcast per (dtype, device)."""
    if dist.get_world_size(group) == 1:
        return
    by_kind = {}
    for buf in model_buffers(wrapped_modules):
        by_kind.setdefault((buf.dtype, buf.device), []).append(buf)
    src = dist.get_global_rank(group, 0)
    for bufs in by_kind.values():
        flat = torch.cat([buf.reshape(-1) for buf in bufs])
        work = dist.broadcast(flat, src=src, group=group, async_op=True)
        wait_within(work, timeout, "the buffer broadcast", flat.device)
        with torch.no_grad():
            for buf, value in zip(bufs, flat.split([buf.numel() for buf in bufs])):
                buf.copy_(value.view_as(buf))
