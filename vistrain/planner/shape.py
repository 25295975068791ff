"""The planner's one input: a run's units, sizes, dtypes and groups (:class:`RunShape`).

:class:`ModelShapes` measures a model config once on the meta device (units per wrap policy,
autograd's saved bytes of one forward) so that a search planning hundreds of knob settings of one
model builds it once; :func:`run_shape` combines it with a config's knobs.
"""

from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Tuple

import torch
from torch import nn

from vistrain.methods import build_meta_model, fp32_units
from vistrain.models.units import CHECKPOINTED
from vistrain.runtime.sharding import wrap_policy
from vistrain.torch_compat import storage_id

MIB = 2**20


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


@dataclass(frozen=True)
class RunShape:
    """What both the memory and the traffic model read of a run."""

    unit_sizes: Tuple[int, ...]  # elements per unit, execution order, root last; DDP: the whole model
    sharded: bool  # AUTO_SETUP_FSDP: the engine (else DDP)
    reshard_after_forward: bool
    precision: Precision
    groups: Groups


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
    own), else measured once in a subprocess (``memory.import_baseline_mib``).
    """

    def __init__(self, model_cfg, baseline_mib: Optional[float] = None):
        self.model = build_meta_model(model_cfg)
        self.head_units = fp32_units(model_cfg)  # the head's fp32 units of the wrap policy
        self.baseline_mib = baseline_mib
        self._units: Dict[Tuple[bool, str], Tuple[int, ...]] = {}
        self._activations: Dict[tuple, Tuple[int, List[int], List[int]]] = {}

    def units(self, low: bool, granularity: str) -> Tuple[int, ...]:
        """:func:`unit_sizes` under the SSL wrap policy."""
        key = (low, granularity)
        if key not in self._units:
            policy = wrap_policy(low, granularity, self.head_units)
            self._units[key] = tuple(unit_sizes(self.model, lambda m: policy(m) is not None))
        return self._units[key]

    def activations(self, data_cfg, batch: int, granularity: Optional[str]):
        """:func:`measure_activations` of a forward of ``batch`` images of ``data_cfg``'s crops."""
        key = (
            tuple(data_cfg.TRANSFORMS.NUM_CROPS),
            tuple(data_cfg.TRANSFORMS.SIZE_CROPS),
            batch,
            granularity,
        )
        if key not in self._activations:
            self._activations[key] = measure_activations(self.model, meta_crops(data_cfg, batch), granularity)
        return self._activations[key]


def measure_activations(model: nn.Module, crops: List[torch.Tensor], granularity: Optional[str]):
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

    target = CHECKPOINTED.get(granularity or "")
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
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(crops)
    for h in handles:
        h.remove()
    return counter[0], per_module, inputs


def meta_crops(data_cfg, batch: int) -> List[torch.Tensor]:
    """One batch of every crop of ``data_cfg.TRANSFORMS``, on the meta device."""
    transforms = data_cfg.TRANSFORMS
    return [
        torch.empty(batch, 3, size, size, device="meta")
        for count, size in zip(transforms.NUM_CROPS, transforms.SIZE_CROPS)
        for _ in range(count)
    ]


def precision_of(cfg) -> Precision:
    """The dtypes a run of ``cfg`` gathers, reduces and computes activations in."""
    fsdp = cfg.MODEL.FSDP_CONFIG
    mixed = bool(fsdp.AUTO_SETUP_FSDP and fsdp.mixed_precision)
    return Precision(
        compute_bytes=2 if mixed else 4,
        reduce_bytes=2 if mixed and not fsdp.fp32_reduce_scatter else 4,
        low=mixed or bool(cfg.MODEL.AMP_PARAMS.USE_AMP),
    )


def groups_of(cfg) -> Groups:
    """The job's ranks as planned: NUM_NODES x NUM_PROC_PER_NODE, shard groups of
    ``shard_group_size`` (0: the world)."""
    per_node = cfg.DISTRIBUTED.NUM_PROC_PER_NODE
    world = cfg.DISTRIBUTED.NUM_NODES * per_node
    return Groups(world, cfg.MODEL.FSDP_CONFIG.shard_group_size or world, per_node)


def run_shape(cfg, shapes: ModelShapes) -> RunShape:
    """The :class:`RunShape` of a training run of ``cfg`` (units from ``shapes``)."""
    fsdp = cfg.MODEL.FSDP_CONFIG
    precision = precision_of(cfg)
    sharded = bool(fsdp.AUTO_SETUP_FSDP)
    if sharded:
        sizes = shapes.units(precision.low, fsdp.wrap_granularity)
    else:
        sizes = (sum(p.numel() for p in shapes.model.parameters()),)
    return RunShape(sizes, sharded, bool(fsdp.reshard_after_forward), precision, groups_of(cfg))


def shapes_for(cfg, shapes: Optional[ModelShapes]) -> ModelShapes:
    """``shapes``, or new ones for ``cfg.MODEL``."""
    return shapes if shapes is not None else ModelShapes(cfg.MODEL)
