"""The planner's one input: everything it reads of a training run (:class:`RunShape`).

:func:`run_shape` reads a config once: the job's ranks, the batch and crops, what the optimizer
and the method add (optimizer state, a momentum teacher, the loss's collectives), synchronised
BatchNorm and every knob; the memory model (``memory.py``), the traffic model (``traffic.py``),
the compute timer and the searches read the :class:`RunShape` and never the config. A knob
setting is ``shape.with_knobs(...)``: a search over hundreds of settings reads the config once.

:class:`ModelShapes` measures a model config once on the meta device (units per wrap policy,
autograd's saved bytes of one forward) and is shared by the shapes of every setting.
"""

import dataclasses
import os
from dataclasses import dataclass
from typing import Callable, Dict, List, Mapping, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

from vistrain.distributed.join import joined_job
from vistrain.methods import build_loss, build_meta_model, fp32_units, method_of
from vistrain.models.units import checkpointed_classes
from vistrain.planner.collectives import Collective
from vistrain.runtime.sharding import wrap_policy
from vistrain.torch_compat import fused_attention, redispatch_torch_function, storage_id

MIB = 2**20
OPTIMIZER_STATES = {"sgd": 1, "lars": 1, "adamw": 2}
Crops = Tuple[Tuple[int, int], ...]  # (count, side in pixels) per resolution


@dataclass(frozen=True)
class Precision:
    """Bytes per element of what a rank moves and keeps."""

    compute_bytes: int  # gathered weights: 2 under the engine's mixed precision, else 4
    reduce_bytes: int  # gradient reductions: 2 under mixed precision without fp32_reduce_scatter
    low: bool  # activations and BatchNorm units in 16 bits (engine mixed precision or AMP)


@dataclass(frozen=True)
class Groups:
    """Ranks of the job: ``shard_ranks`` (k) hold one copy of the state between them; with
    ``world // k`` > 1 replicas (hybrid sharding). Nodes hold ``ranks_per_node`` consecutive ranks."""

    world: int
    shard_ranks: int
    ranks_per_node: int

    @property
    def replicas(self) -> int:
        return self.world // self.shard_ranks


def unit_sizes(model: nn.Module, is_unit: Callable[[nn.Module], bool]) -> List[int]:
    """Elements of each sharded unit, in module (execution) order, nested units before the
    unit holding them; the root last.

    Mirrors ``auto_wrap``: every module ``is_unit`` selects holds its parameters not inside a
    nested unit; the root holds the rest.
    """
    sizes: List[int] = []

    def owned(module: nn.Module) -> int:
        total = sum(p.numel() for p in module.parameters(recurse=False))
        for child in module.children():
            if is_unit(child):
                sizes.append(owned(child))
            else:
                total += owned(child)
        return total

    sizes.append(owned(model))
    return sizes


class ModelShapes:
    """Measurements of one ``MODEL`` config, each made once: the meta model, its units per
    (low precision, wrap granularity) and its saved activations per (batch, checkpointing).

    ``baseline_mib``: the RSS of a process that imported what a rank imports (the launcher's
    own), else measured once in a subprocess (``memory.import_baseline_mib``). ``loss_cfg``: the
    run's LOSS, whose method may mask the student's crops (MAE: the encoder's shorter sequence);
    the traced forward draws its masks as a step does.
    """

    def __init__(self, model_cfg, baseline_mib: Optional[float] = None, loss_cfg=None):
        self.model = build_meta_model(model_cfg)
        self.masking = build_loss(loss_cfg, model_cfg).masking if loss_cfg is not None else None
        self.head_units = fp32_units(model_cfg)  # the head's fp32 units of the wrap policy
        self.channels = model_cfg.TRUNK.IN_CHANNELS
        self.baseline_mib = baseline_mib
        self._units: Dict[Tuple[bool, str], Tuple[int, ...]] = {}
        self._activations: Dict[tuple, Tuple[int, List[int], List[int]]] = {}

    def units(self, low: bool, granularity: str) -> Tuple[int, ...]:
        """:func:`unit_sizes` under the SSL wrap policy."""
        key = (low, granularity)
        if key not in self._units:
            policy = wrap_policy(low, granularity, self.head_units, self.model)
            self._units[key] = tuple(unit_sizes(self.model, lambda m: policy(m) is not None))
        return self._units[key]

    def activations(self, crops: Crops, batch: int, granularity: Optional[str]):
        """:func:`measure_activations` of a forward of ``batch`` images of ``crops``."""
        key = (crops, batch, granularity)
        if key not in self._activations:
            self._activations[key] = measure_activations(
                self.model, meta_crops(crops, batch, self.channels), granularity, self.masking
            )
        return self._activations[key]


def measure_activations(
    model: nn.Module,
    crops: List[torch.Tensor],
    granularity: Optional[str],
    masking: Optional[Callable] = None,
):
    """(total saved bytes, [saved bytes per checkpoint module], [input bytes per module]) of one
    forward on the meta device: autograd's saved tensors, each storage once, weights excluded."""
    weights = {storage_id(p) for p in model.parameters()}
    seen, counter = set(), [0]

    def pack(t):
        key = storage_id(t)
        if key not in weights and key not in seen:
            seen.add(key)
            counter[0] += t.untyped_storage().nbytes()
        return t

    target = checkpointed_classes(model, granularity) if granularity else None
    per_module, inputs, started_at = [], [], {}

    def pre(module, args):
        started_at[id(module)] = counter[0]
        inputs.append(sum(a.untyped_storage().nbytes() for a in args if isinstance(a, torch.Tensor)))

    def post(module, args, output):
        per_module.append(counter[0] - started_at[id(module)])

    handles = []
    for m in model.modules():
        if target is not None and isinstance(m, target):
            handles += [m.register_forward_pre_hook(pre), m.register_forward_hook(post)]
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), FusedAttention():
        model(crops, **(masking(crops) if masking is not None else {}))
    for h in handles:
        h.remove()
    return counter[0], per_module, inputs


class FusedAttention(TorchFunctionMode):
    """``F.scaled_dot_product_attention`` on the meta device as a run computes it: the fused
    (flash) kernel, which saves q, k, v, the output and the (N, h, L) log-sum-exp of the softmax,
    not the math path's (N, h, L, L) attention weights (the meta device has no fused kernel and
    falls back to the math path). Masked or dropout attention keeps the math path, as a run does
    on the CPU. ``nn.MultiheadAttention`` calls it inside ``F.multi_head_attention_forward``, itself
    a torch function: the mode stays active inside that one (``redispatch_torch_function``)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention and _fusable(*args, **kwargs):
            q, k, v = args[:3]
            return fused_attention(q, k, v, bool(kwargs.get("is_causal", False)), kwargs.get("scale"))
        if func is F.multi_head_attention_forward:  # the mode on again for the attention inside
            with self:
                out = redispatch_torch_function(func, types, args, kwargs)
            if out is not None:
                return out
        return func(*args, **kwargs)


def _fusable(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False) -> bool:
    return q.is_meta and attn_mask is None and dropout_p == 0.0 and not enable_gqa and q.dim() == 4


def meta_crops(crops: Crops, batch: int, channels: int = 3) -> List[torch.Tensor]:
    """One batch of every crop of ``crops`` ((count, side) per resolution), on the meta device."""
    return [
        torch.empty(batch, channels, side, side, device="meta") for count, side in crops for _ in range(count)
    ]


def crops_of(data_cfg) -> Crops:
    """``DATA.<split>.TRANSFORMS``' crops as (count, side) per resolution."""
    transforms = data_cfg.TRANSFORMS
    return tuple(zip(transforms.NUM_CROPS, transforms.SIZE_CROPS))


@dataclass(frozen=True)
class RunShape:
    """What the memory and the traffic model read of a training run (module docstring).

    The knobs' fields have the knobs' names (``knobs.EXACT_KNOBS``, ``mixed_precision``);
    ``unit_sizes`` follows from the model, the precision and ``wrap_granularity``.
    """

    model: ModelShapes  # the meta model and its measurements
    # the job
    world: int  # ranks
    ranks_per_node: int
    spawns_ranks: bool  # the command line's launcher starts this node's ranks (not torchrun / srun)
    cuda: bool  # MACHINE.DEVICE is cuda
    nccl: bool  # collectives on NCCL (CUDA without a gloo BACKEND)
    batch: int  # images per rank (DATA.TRAIN.BATCHSIZE_PER_REPLICA)
    crops: Crops
    # what the optimizer and the method add
    optimizer_states: int  # state tensors per parameter
    teacher: bool  # a momentum teacher, built and wrapped like the student
    loss: Tuple[Collective, ...]  # the loss's own collectives of one step, at this world and batch
    loss_memory: int  # bytes the loss adds at its peak to the activations (``Method.loss_memory``)
    sync_bn: bool
    sync_bn_group_size: int  # 0: all ranks
    step_in_backward_allowed: bool  # no global clipping nor fp16 scaling (which need every gradient)
    # the engine and its knobs
    sharded: bool  # AUTO_SETUP_FSDP (else DDP)
    engine: str  # MODEL.FSDP_CONFIG.BACKEND: builtin (its exact knobs apply) | torch (fully_shard)
    shard_group_size: int  # 0: all ranks
    wrap_granularity: str
    reshard_after_forward: bool
    prefetch_depth: int
    activation_checkpointing: bool
    checkpointing_granularity: str
    step_in_backward: bool
    move_params_to_cpu: bool
    cpu_mmap_threshold_mib: float
    mixed_precision: bool  # the engine's (gathers and compute in ``compute_dtype``)
    compute_dtype: str
    fp32_reduce_scatter: bool
    amp: bool  # autocast
    amp_dtype: str
    unit_sizes: Tuple[int, ...]  # elements per unit, execution order, root last; DDP: the whole model

    @property
    def precision(self) -> Precision:
        """The dtypes the run gathers, reduces and computes activations in."""
        mixed = self.sharded and self.mixed_precision
        return Precision(
            compute_bytes=2 if mixed else 4,
            reduce_bytes=2 if mixed and not self.fp32_reduce_scatter else 4,
            low=mixed or self.amp,
        )

    @property
    def groups(self) -> Groups:
        """The job's ranks as planned, shard groups of ``shard_group_size`` (0: the world)."""
        return Groups(self.world, self.shard_group_size or self.world, self.ranks_per_node)

    @property
    def builtin(self) -> bool:
        """The built-in engine shards the model (its exact knobs apply)."""
        return self.sharded and self.engine == "builtin"

    @property
    def nodes(self) -> int:
        return self.world // self.ranks_per_node

    @property
    def checkpointed(self) -> Optional[str]:
        """The granularity activation checkpointing recomputes at; None when it is off."""
        return self.checkpointing_granularity if self.activation_checkpointing else None

    def knobs(self, names: Sequence[str]) -> Dict[str, object]:
        """The values of the knobs ``names`` (``batch_per_replica`` and ``ranks`` included)."""
        fields = {"batch_per_replica": "batch", "ranks": "world"}
        return {name: getattr(self, fields.get(name, name)) for name in names}

    def with_knobs(self, knobs: Mapping[str, object]) -> "RunShape":
        """This run with the exact knobs and ``mixed_precision`` of ``knobs`` set. (The batch and
        the ranks change the job and the loss's traffic: a new :func:`run_shape` of the config.)"""
        unknown = [name for name in knobs if name not in KNOB_FIELDS]
        if unknown:
            raise KeyError(f"not a knob of a RunShape: {', '.join(unknown)}; build one from the config")
        shape = dataclasses.replace(self, **knobs)
        return dataclasses.replace(shape, unit_sizes=_unit_sizes(shape))


# the knobs RunShape.with_knobs sets (the fields of those names)
KNOB_FIELDS = frozenset(
    (
        "wrap_granularity", "reshard_after_forward", "prefetch_depth", "activation_checkpointing",
        "checkpointing_granularity", "step_in_backward", "move_params_to_cpu", "cpu_mmap_threshold_mib",
        "shard_group_size", "mixed_precision",
    )
)  # fmt: skip


def run_shape(cfg, shapes: Optional[ModelShapes] = None) -> RunShape:
    """The :class:`RunShape` of a training run of ``cfg``: the one place the planner reads a
    config (``shapes``: the measurements of ``cfg.MODEL``, shared between configs of one model)."""
    shapes = shapes if shapes is not None else ModelShapes(cfg.MODEL, loss_cfg=cfg.LOSS)
    dist, fsdp, amp = cfg.DISTRIBUTED, cfg.MODEL.FSDP_CONFIG, cfg.MODEL.AMP_PARAMS
    checkpointing, optim = cfg.MODEL.ACTIVATION_CHECKPOINTING, cfg.OPTIMIZER
    world = dist.NUM_NODES * dist.NUM_PROC_PER_NODE
    shape = RunShape(
        model=shapes,
        world=world,
        ranks_per_node=dist.NUM_PROC_PER_NODE,
        spawns_ranks=spawns_ranks(dist),
        cuda=cfg.MACHINE.DEVICE == "cuda",
        nccl=cfg.MACHINE.DEVICE == "cuda" and dist.BACKEND != "gloo",
        batch=cfg.DATA.TRAIN.BATCHSIZE_PER_REPLICA,
        crops=crops_of(cfg.DATA.TRAIN),
        optimizer_states=optimizer_states(optim),
        teacher=method_of(cfg.LOSS).teacher,
        loss=loss_collectives(cfg, world),
        loss_memory=method_of(cfg.LOSS).loss_memory(cfg),
        sync_bn=bool(cfg.MODEL.SYNC_BN_CONFIG.CONVERT_BN_TO_SYNC_BN),
        sync_bn_group_size=cfg.MODEL.SYNC_BN_CONFIG.GROUP_SIZE,
        step_in_backward_allowed=not (
            optim.clip_grad_norm > 0 or (amp.USE_AMP and amp.AMP_DTYPE == "float16")
        ),
        sharded=bool(fsdp.AUTO_SETUP_FSDP),
        engine=fsdp.BACKEND,
        shard_group_size=fsdp.shard_group_size,
        wrap_granularity=fsdp.wrap_granularity,
        reshard_after_forward=bool(fsdp.reshard_after_forward),
        prefetch_depth=fsdp.prefetch_depth,
        activation_checkpointing=bool(checkpointing.USE_ACTIVATION_CHECKPOINTING),
        checkpointing_granularity=checkpointing.GRANULARITY,
        step_in_backward=bool(optim.step_in_backward),
        move_params_to_cpu=bool(fsdp.move_params_to_cpu),
        cpu_mmap_threshold_mib=float(cfg.MACHINE.CPU_MMAP_THRESHOLD_MIB),
        mixed_precision=bool(fsdp.mixed_precision),
        compute_dtype=fsdp.compute_dtype,
        fp32_reduce_scatter=bool(fsdp.fp32_reduce_scatter),
        amp=bool(amp.USE_AMP),
        amp_dtype=amp.AMP_DTYPE,
        unit_sizes=(),
    )
    return dataclasses.replace(shape, unit_sizes=_unit_sizes(shape))


def _unit_sizes(shape: RunShape) -> Tuple[int, ...]:
    if shape.sharded:
        return shape.model.units(shape.precision.low, shape.wrap_granularity)
    return (sum(p.numel() for p in shape.model.model.parameters()),)


def loss_collectives(cfg, world: int) -> Tuple[Collective, ...]:
    """The method's own collectives in one step, over every rank (``Method.collectives``)."""
    everyone = (tuple(range(world)),)
    return tuple(
        Collective(c.op, c.nbytes, everyone, c.calls, "loss")
        for c in method_of(cfg.LOSS).collectives(cfg, world)
    )


def optimizer_states(optim_cfg) -> int:
    """Optimizer state tensors per parameter: momentum buffers, AdamW's two moments."""
    momentum = optim_cfg.momentum > 0 or optim_cfg.name == "adamw"
    return OPTIMIZER_STATES.get(optim_cfg.name, 1) if momentum else 0


def spawns_ranks(dist_cfg) -> bool:
    """Whether the command line's launcher starts this node's ranks itself, several of them (not
    torchrun / srun, which start them; ``vistrain.distributed.spawn``)."""
    return dist_cfg.NUM_PROC_PER_NODE > 1 and joined_job(dist_cfg, os.environ) is None
