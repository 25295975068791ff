"""Build a momentum teacher the way the student was built: same builder, same wrap policy.

Both then have the same units and the same shard layout, so the EMA is an elementwise update of
local shards (``vistrain.fsdp.ema_update_``). The teacher has no gradients (its shards are built
with ``requires_grad=False``, so the optimizer never sees them) and starts as an exact copy of the
student. Under DDP (``AUTO_SETUP_FSDP=False``) it is a plain module on the device: DDP has nothing
to reduce for it, and its synced BatchNorms keep the ranks' statistics equal.
"""

from typing import Callable

import torch
from torch import nn

from vistrain.distributed.sync_batchnorm import convert_sync_batchnorm, sync_bn_process_group
from vistrain.fsdp import ema_update_
from vistrain.runtime.parallel import parallelize
from vistrain.runtime.sharding import build_for_run


def build_teacher(
    build_fn: Callable[..., nn.Module],
    model_cfg,
    device: torch.device,
    student: nn.Module,
) -> nn.Module:
    """The teacher for ``student`` (already parallelized from ``build_fn(model_cfg)``).

    Built under a forked RNG: the student's run sees the same random numbers with or without a
    teacher. Collective under AUTO_SETUP_FSDP (wrapping, broadcasts).
    """
    devices = [device.index or 0] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        teacher = build_for_run(build_fn, model_cfg)
        teacher.requires_grad_(False)  # before sharding: the engine builds gradient-free shards
        if model_cfg.FSDP_CONFIG.AUTO_SETUP_FSDP:
            teacher = parallelize(teacher, model_cfg, device)
        else:
            teacher = _plain(teacher, model_cfg, device)
    ema_update_(teacher, student, 0.0)  # start as the student
    return teacher.train()  # batch statistics in the teacher's BatchNorms, as DINO and BYOL


def _plain(model: nn.Module, model_cfg, device: torch.device) -> nn.Module:
    model = model.to(device)
    sync = model_cfg.SYNC_BN_CONFIG
    if sync.CONVERT_BN_TO_SYNC_BN:
        model = convert_sync_batchnorm(model, sync_bn_process_group(sync.GROUP_SIZE))
    return model
