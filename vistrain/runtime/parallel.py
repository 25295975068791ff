"""Turn a plain model into this rank's data-parallel model (a transform applied after building).

``parallelize`` is the one place that decides how a model is distributed: DDP (replicated weights,
all-reduced gradients) or, with ``MODEL.FSDP_CONFIG.AUTO_SETUP_FSDP``, the sharded engine. Both
wrappers offer ``no_sync()`` for gradient accumulation, which is all the trainer relies on.
"""

import inspect
from typing import Callable, Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from vistrain.distributed.sync_batchnorm import convert_sync_batchnorm, sync_bn_process_group
from vistrain.runtime.sharding import apply_activation_checkpointing, shard_model


def parallelize(
    model: nn.Module,
    model_cfg,
    device: torch.device,
    param_group_fn: Optional[Callable] = None,
    shard: Optional[bool] = None,
) -> nn.Module:
    """``model`` on ``device``, with sync BN and activation checkpointing if configured, wrapped
    for data parallelism: DDP, or the sharded engine with ``MODEL.FSDP_CONFIG.AUTO_SETUP_FSDP``.

    Needs an initialised process group (``vistrain.distributed.launch`` always creates one, also
    for a single process). ``model_cfg`` is the ``MODEL`` section. ``param_group_fn(fqn, module,
    param) -> key`` keeps optimizer parameter groups apart in flat shards. ``shard`` overrides
    AUTO_SETUP_FSDP (linear-eval heads are tiny: always DDP).
    """
    if not dist.is_initialized():
        raise RuntimeError(
            "parallelize needs a process group; start the run with vistrain.distributed.launch"
        )
    if not any(p.is_meta for p in model.parameters()):  # meta: the sharded engine creates it per unit
        model = model.to(device)
    if model_cfg.SYNC_BN_CONFIG.CONVERT_BN_TO_SYNC_BN:
        model = _convert_sync_bn(model, model_cfg.SYNC_BN_CONFIG.GROUP_SIZE)
    checkpointing = model_cfg.ACTIVATION_CHECKPOINTING
    if checkpointing.USE_ACTIVATION_CHECKPOINTING:
        apply_activation_checkpointing(model, checkpointing.GRANULARITY)
    if model_cfg.FSDP_CONFIG.AUTO_SETUP_FSDP if shard is None else shard:
        return shard_model(model, model_cfg, param_group_fn)
    return _wrap_ddp(model, device, sync_bn=model_cfg.SYNC_BN_CONFIG.CONVERT_BN_TO_SYNC_BN)


def _convert_sync_bn(model: nn.Module, group_size: int) -> nn.Module:
    return convert_sync_batchnorm(model, sync_bn_process_group(group_size))


def _wrap_ddp(model: nn.Module, device: torch.device, sync_bn: bool) -> DDP:
    # Synced BN already keeps running statistics identical on all ranks; without it rank 0's
    # buffers are broadcast every forward (DDP's default), as in VISSL. Newer torch renamed the
    # switch (the old name warns).
    sync_buffers = "forward_sync_buffers" if "forward_sync_buffers" in _DDP_ARGS else "broadcast_buffers"
    # its own group (collective: every rank creates it): the default group's small collectives
    # (sync BatchNorm's all-reduces, the loss's) must not queue behind a bucket's megabytes on the
    # same connections (dev/nodes/diagnose_two_hosts.py)
    group = dist.new_group(list(range(dist.get_world_size()))) if dist.get_world_size() > 1 else None
    return DDP(
        model,
        device_ids=[device.index] if device.type == "cuda" else None,
        find_unused_parameters=False,
        process_group=group,
        **{sync_buffers: not sync_bn},
    )


_DDP_ARGS = inspect.signature(DDP.__init__).parameters
