"""AUTO_SETUP_FSDP: turn a built SSL model into a sharded one (a transform; models stay plain).

Units: the SSL table of ``vistrain.models.units`` (trunk blocks or stages, head MLPs, the fp32
units the run's head names: ``vistrain.methods.fp32_units``) plus every large layer, and the whole model as root. Under AMP or
the engine's mixed precision every BatchNorm also becomes its own fp32 unit (parameters, buffers
and arithmetic), so statistics never see bf16/fp16.
"""

import contextlib
import functools
import logging
from typing import Callable, Optional, Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.checkpoint import checkpoint

from vistrain.fsdp import (
    KEEP_FP32,
    Precision,
    RootOptions,
    TorchShardedModel,
    auto_wrap,
    by_class,
    hybrid_groups,
)
from vistrain.fsdp.deferred_init import build_on_meta
from vistrain.methods import fp32_units
from vistrain.models.units import CHECKPOINTED, checkpointed_classes, is_large_layer, unit_classes
from vistrain.runtime.precision import compute_dtype
from vistrain.torch_compat import BatchNormBase

BACKENDS = ("builtin", "torch")
logger = logging.getLogger("vistrain")


def wrap_policy(
    fp32_batchnorm: bool,
    granularity: str = "block",
    head_units: Sequence[type] = (),
    model: Optional[nn.Module] = None,
) -> Callable[[nn.Module], Optional[dict]]:
    """The builtin backend's units: :func:`unit_classes` (``head_units``: the head's fp32 units;
    ``model``: the model to wrap, whose library trunks add their blocks) plus every large layer;
    the fp32 units run in full precision with autocast off (``KEEP_FP32``)."""
    table = unit_classes(fp32_batchnorm, granularity, head_units, model)
    by_type = by_class(
        {cls: {"precision": KEEP_FP32} if opts.get("keep_fp32") else {} for cls, opts in table.items()}
    )

    def policy(module: nn.Module) -> Optional[dict]:
        overrides = by_type(module)
        if overrides is None and is_large_layer(module):
            return {}
        return overrides

    return policy


def apply_activation_checkpointing(model: nn.Module, granularity: str) -> nn.Module:
    """Recompute each trunk block ("block") or stage ("stage") in backward instead of storing
    its activations. Patches ``forward`` in place, so parameter names do not change.

    Exact: the recomputation sees the same inputs and weights, and its BatchNorms use the batch
    statistics without moving the running ones a second time (torch's checkpoint alone would
    apply the momentum twice per step)."""
    if granularity not in CHECKPOINTED:
        raise ValueError(
            f"MODEL.ACTIVATION_CHECKPOINTING.GRANULARITY must be one of "
            f"{sorted(CHECKPOINTED)}, got {granularity!r}"
        )
    classes = checkpointed_classes(model, granularity)
    for module in model.modules():
        if isinstance(module, classes):
            contexts = functools.partial(_recompute_contexts, module)
            module.forward = functools.partial(_checkpointed, module.forward, contexts)
    return model


def _checkpointed(forward: Callable, contexts: Callable, *args, **kwargs):
    return checkpoint(forward, *args, use_reentrant=False, context_fn=contexts, **kwargs)


def _recompute_contexts(module: nn.Module):
    """(context of the first forward, context of the recomputation in backward)."""
    return contextlib.nullcontext(), _running_stats_frozen(module)


@contextlib.contextmanager
def _running_stats_frozen(module: nn.Module):
    """BatchNorms recompute with momentum 0: the same batch statistics and saved tensors as the
    first forward, running mean and variance updated by ``(1 - 0) * r + 0 * batch = r``; the batch
    count they advance is put back."""
    norms = [m for m in module.modules() if isinstance(m, BatchNormBase) and m.track_running_stats]
    saved = [(norm.momentum, norm.num_batches_tracked.clone()) for norm in norms]
    for norm in norms:
        norm.momentum = 0.0
    try:
        yield
    finally:
        for norm, (momentum, count) in zip(norms, saved):
            norm.momentum = momentum
            norm.num_batches_tracked.copy_(count)


def initialises_per_unit(model_cfg) -> bool:
    """Whether the run builds the model on the meta device and lets the sharded engine create
    and initialise it unit by unit (``vistrain.fsdp.build_on_meta``): the builtin backend of
    AUTO_SETUP_FSDP. Same initial weights as a plain build with the same seed."""
    fsdp_cfg = model_cfg.FSDP_CONFIG
    return bool(fsdp_cfg.AUTO_SETUP_FSDP) and fsdp_cfg.BACKEND == "builtin"


def build_for_run(build_fn: Callable[..., nn.Module], model_cfg) -> nn.Module:
    """``build_fn(model_cfg)``: on the meta device when :func:`initialises_per_unit`, else plain.
    A model whose initialisation cannot be replayed unit by unit (torchvision's Swin and ConvNeXt:
    ``torch.nn.init.trunc_normal_``) is built whole, with one warning naming why: the same
    weights, the full model in memory once while it is sharded."""
    if initialises_per_unit(model_cfg):
        state = torch.random.get_rng_state()
        try:
            return build_on_meta(build_fn, model_cfg)
        except (ValueError, NotImplementedError) as e:  # cannot be replayed: build it whole
            torch.random.set_rng_state(state)
            logger.warning(f"per-unit initialisation refused ({e}); building the whole model first")
    return build_fn(model_cfg)


def shard_model(model: nn.Module, model_cfg, param_group_fn: Optional[Callable] = None) -> nn.Module:
    """Wrap ``model`` (already on its device, BN already converted) as configured.

    ``model_cfg`` is the MODEL section; ``param_group_fn(fqn, module, param) -> key`` keeps
    optimizer groups apart in the flat shards (builtin backend).
    """
    fsdp_cfg = model_cfg.FSDP_CONFIG
    # BACKEND and compute_dtype were checked before launch (vistrain.config.checks)
    low_precision = fsdp_cfg.mixed_precision or model_cfg.AMP_PARAMS.USE_AMP
    head_units = fp32_units(model_cfg)
    classes = unit_classes(low_precision, fsdp_cfg.wrap_granularity, head_units, model)
    if fsdp_cfg.BACKEND == "torch":
        sharded = torch_fully_shard(
            model, classes, fsdp_cfg.reshard_after_forward, fsdp_cfg.shard_group_size,
            compute_dtype(fsdp_cfg), fsdp_cfg.fp32_reduce_scatter,
        )  # fmt: skip
        return TorchShardedModel(sharded)
    return auto_wrap(
        model,
        wrap_policy(low_precision, fsdp_cfg.wrap_granularity, head_units, model),
        # hybrid sharding: shards within groups of shard_group_size ranks, replicas across them
        groups=hybrid_groups(fsdp_cfg.shard_group_size),
        reshard_after_forward=fsdp_cfg.reshard_after_forward,
        precision=unit_precision(fsdp_cfg),
        flatten_parameters=fsdp_cfg.flatten_parameters,
        move_params_to_cpu=fsdp_cfg.move_params_to_cpu,
        param_group_fn=param_group_fn,
        gather_public_methods=fsdp_cfg.GATHER_PUBLIC_METHODS,
        root=RootOptions(
            # as the DDP path: synced BN keeps statistics equal, else rank 0's are broadcast
            broadcast_buffers=not model_cfg.SYNC_BN_CONFIG.CONVERT_BN_TO_SYNC_BN,
            prefetch_depth=fsdp_cfg.prefetch_depth,
        ),
    )


def unit_precision(fsdp_cfg) -> Precision:
    """The engine's :class:`Precision` for ``MODEL.FSDP_CONFIG``: ``compute_dtype`` under
    ``mixed_precision``, gradients reduced in fp32 with ``fp32_reduce_scatter``. Without mixed
    precision gradients are reduced in the parameters' own dtype (a float64 model in float64)."""
    dtype = compute_dtype(fsdp_cfg)
    reduce = torch.float32 if fsdp_cfg.fp32_reduce_scatter and dtype is not None else None
    return Precision(dtype, reduce)


def torch_mesh(device_type: str, shard_group_size: int):
    """FSDP2's device mesh: 1-D over all ranks, or 2-D ``(replicate, shard)`` for hybrid
    sharding (HSDP), rows of ``shard_group_size`` consecutive ranks as our shard groups."""
    from torch.distributed.device_mesh import init_device_mesh

    world = dist.get_world_size()
    k = shard_group_size or world
    if k == world:
        return init_device_mesh(device_type, (world,))
    return init_device_mesh(device_type, (world // k, k), mesh_dim_names=("replicate", "shard"))


def torch_fully_shard(
    model: nn.Module,
    classes: dict,
    reshard_after_forward: bool,
    shard_group_size: int = 0,
    dtype: Optional[torch.dtype] = None,
    fp32_reduce_scatter: bool = False,
) -> nn.Module:
    """The same wrap policy through PyTorch's ``fully_shard`` (FSDP2), for comparison: every
    module of ``classes`` (children before parents; ``keep_fp32`` ones without mixed precision),
    then ``model``, on :func:`torch_mesh`. Returns ``model``, sharded in place."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    device = next(model.parameters()).device
    mesh = torch_mesh(device.type, shard_group_size)
    low = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32 if fp32_reduce_scatter else None)
    full = MixedPrecisionPolicy()
    for module in list(model.modules())[::-1]:  # children before parents
        options = next((opts for cls, opts in classes.items() if isinstance(module, cls)), None)
        if options is not None:
            fully_shard(
                module,
                mesh=mesh,
                reshard_after_forward=reshard_after_forward,
                mp_policy=full if options.get("keep_fp32") else low,
            )
    fully_shard(model, mesh=mesh, reshard_after_forward=reshard_after_forward, mp_policy=low)
    return model
