"""The knobs a run's memory and speed depend on, what each costs in time, and the search over them.

Exact knobs never change the numbers a run computes (same losses, same weights): which modules
are units, ZeRO-3 or ZeRO-2, how far gathers run ahead, activation checkpointing (its
recomputation leaves BatchNorm statistics as they were), the optimizer step inside backward, CPU
offload, the glibc allocator setting. Result knobs do change them: mixed precision, the batch per
rank, the number of ranks. The auto-tuner (``auto_tune.py``) chooses exact knobs only; the budget
search of ``tools/plan_memory.py`` (:func:`search`) may also move the result knobs.

Speed is measured side by side on this project's 2-core CPU machine (``dev/bench/bench_fsdp.py``, 2
ranks, one thread each, RegNetY-400MF; docs/notes/memory.md has the runs): ``STEP_VS_DDP`` per (wrap
granularity, reshard) as the step time over DDP's, times the cost of prefetch depth and the step
in backward, plus the recomputation of checkpointing, times the allocator threshold's cost.
Factors not measurable here (no GPU: mixed precision on CUDA, CPU offload) are common practice
and say so.
"""

import copy
import itertools
import math
from typing import Dict, List, Optional, Sequence, Tuple

from vistrain.config.checks import get_key
from vistrain.planner.memory import MemoryPlan, plan
from vistrain.planner.shape import MIB, ModelShapes, RunShape, run_shape

# knob -> config key. Exact: the tuner may set these.
EXACT_KNOBS = {
    "wrap_granularity": "MODEL.FSDP_CONFIG.wrap_granularity",
    "reshard_after_forward": "MODEL.FSDP_CONFIG.reshard_after_forward",
    "prefetch_depth": "MODEL.FSDP_CONFIG.prefetch_depth",
    "activation_checkpointing": "MODEL.ACTIVATION_CHECKPOINTING.USE_ACTIVATION_CHECKPOINTING",
    "checkpointing_granularity": "MODEL.ACTIVATION_CHECKPOINTING.GRANULARITY",
    "step_in_backward": "OPTIMIZER.step_in_backward",
    "move_params_to_cpu": "MODEL.FSDP_CONFIG.move_params_to_cpu",
    "cpu_mmap_threshold_mib": "MACHINE.CPU_MMAP_THRESHOLD_MIB",
    "shard_group_size": "MODEL.FSDP_CONFIG.shard_group_size",
}
# Result knobs: only advised (ranks stands for DISTRIBUTED.NUM_PROC_PER_NODE x NUM_NODES).
RESULT_KNOBS = {
    "mixed_precision": "MODEL.FSDP_CONFIG.mixed_precision",
    "batch_per_replica": "DATA.TRAIN.BATCHSIZE_PER_REPLICA",
    "ranks": "DISTRIBUTED.NUM_PROC_PER_NODE",
}
KNOB_KEYS = {**EXACT_KNOBS, **RESULT_KNOBS}

# Measured (dev/bench/bench_fsdp.py, first run of 2026-12-01; docs/notes/memory.md): step time over DDP's per
# (wrap granularity, reshard_after_forward). "model" keeps the root gathered, so ZeRO-3 there
# differs from ZeRO-2 only for the fp32 units.
STEP_VS_DDP = {
    ("model", False): 0.99,
    ("model", True): 1.03,
    ("stage", False): 1.09,
    ("stage", True): 1.23,
    ("block", False): 1.20,
    ("block", True): 1.36,
}
# shard_group_size=1: every rank holds the whole model and all-reduces each unit's gradient over the
# world, as DDP does its buckets; per wrap granularity (ZeRO-3 only frees and copies local weights
# again). Measured side by side with DDP and the sharded settings (dev/bench/bench_fsdp.py --replicated,
# two runs of 2026-12-03, median; a loaded machine: load average 23, ratios within +-0.15): one
# unit reduces everything after backward, overlapping nothing, where DDP's buckets overlap it.
REPLICATED_VS_DDP = {"model": 1.55, "stage": 1.19, "block": 1.22}
# Checkpointing runs each checkpointed forward again in backward: compute, not communication, so
# it adds the same time (in DDP steps) at every granularity; a multiplier mis-ordered 19 of 331
# measured pairs of the first run.
CHECKPOINTING_EXTRA = {"block": 0.48, "stage": 0.43}
# Gathers issued ahead of the unit that needs them: depth 0 measured 1.02; depth 2 0.98, within
# the noise, counted as 1.0 so that a third gathered unit is not bought for nothing.
PREFETCH_COST = {0: 1.02, 1: 1.0, 2: 1.0}
# The same update shard by shard inside backward: 0.99 measured (noise); ranked just after the
# ordinary step so that it is used where it is needed to fit.
IN_BACKWARD_COST = 1.01
# glibc's fixed mmap threshold (MACHINE.CPU_MMAP_THRESHOLD_MIB): page faults on every large
# allocation (dev/bench/bench_host_memory.py, the quick start's model at 1 MiB)
CPU_THRESHOLD_COST = 1.27
OFFLOAD_COST = 1.5  # CUDA: shards, gradients and optimizer state over PCIe (assumed, no GPU here)
MIXED_PRECISION_COST = {"cuda": 0.6, "cpu": 1.05}  # bf16 compute (CUDA: common practice)


def speed_cost(knobs: Dict[str, object], device: str) -> float:
    """Relative time per image of a knob setting (lower is faster; DDP without checkpointing is
    1): the factors above; a setting without the engine's knobs is DDP's; the engine's knobs a
    setting does not name are at their defaults. ``ranks`` divides (more ranks, more images)."""
    cost = 1.0
    if knobs.get("shard_group_size") == 1:  # replicated: no gathers, one all-reduce per unit
        cost = REPLICATED_VS_DDP[knobs.get("wrap_granularity", "block")]
    elif "wrap_granularity" in knobs or "reshard_after_forward" in knobs:  # the sharded engine's
        granularity = knobs.get("wrap_granularity", "block")
        cost = STEP_VS_DDP[(granularity, bool(knobs.get("reshard_after_forward", True)))]
        cost *= PREFETCH_COST.get(int(knobs.get("prefetch_depth", 1)), 1.0)
    cost *= IN_BACKWARD_COST if knobs.get("step_in_backward") else 1.0
    if knobs.get("activation_checkpointing"):
        cost += CHECKPOINTING_EXTRA[knobs.get("checkpointing_granularity", "block")]
    cost *= CPU_THRESHOLD_COST if knobs.get("cpu_mmap_threshold_mib") else 1.0
    cost *= OFFLOAD_COST if knobs.get("move_params_to_cpu") else 1.0
    cost *= MIXED_PRECISION_COST[device] if knobs.get("mixed_precision") else 1.0
    return cost / knobs.get("ranks", 1)


def exact_choices(shape: RunShape, device: str) -> Dict[str, tuple]:
    """The values each exact knob may take for ``shape`` on ``device``, the preferred one first."""
    choices = {"activation_checkpointing": (False, True), "checkpointing_granularity": ("block", "stage")}
    if not shape.builtin:
        return choices
    choices.update(
        shard_group_size=shard_group_choices(shape),
        wrap_granularity=("model", "stage", "block"),
        reshard_after_forward=(False, True),
        prefetch_depth=(1, 0, 2),
        step_in_backward=(False, True) if shape.step_in_backward_allowed else (False,),
    )
    if device == "cuda":
        choices["move_params_to_cpu"] = (False, True)
    else:
        choices["cpu_mmap_threshold_mib"] = (0.0, 1.0)
    return choices


def shard_group_choices(shape: RunShape) -> tuple:
    """``shard_group_size`` values worth planning: 0 (shard over all ranks), a node's ranks
    (hybrid sharding) when the job spans nodes, and 1 (every rank holds everything, DDP's
    replication through the engine)."""
    per_node, nodes = shape.ranks_per_node, shape.nodes
    choices = [0]
    if nodes > 1 and per_node > 1:
        choices.append(per_node)
    if nodes * per_node > 1:
        choices.append(1)
    return tuple(choices)


def current_knobs(cfg, names: Sequence[str]) -> Dict[str, object]:
    """The values ``cfg`` holds for the knobs ``names``."""
    return {name: get_key(cfg, KNOB_KEYS[name]) for name in names}


def exact_settings(shape: RunShape, device: str, fixed: Sequence[str] = ()) -> List[Dict[str, object]]:
    """Every combination of exact knob values; the knobs in ``fixed`` keep ``shape``'s value.
    The checkpointing granularity only varies when checkpointing is on."""
    choices = exact_choices(shape, device)
    held = shape.knobs([name for name in choices if name in fixed])
    names = list(choices)
    settings, seen = [], set()
    for values in itertools.product(*((held[n],) if n in held else choices[n] for n in names)):
        knobs = dict(zip(names, values))
        if not knobs["activation_checkpointing"] and "checkpointing_granularity" not in held:
            knobs["checkpointing_granularity"] = shape.checkpointing_granularity
        key = tuple(knobs.items())
        if key not in seen:
            seen.add(key)
            settings.append(knobs)
    return settings


def with_knobs(cfg, knobs: Dict[str, object]):
    """A copy of ``cfg`` (frozen like it) with the knobs set, in order; ``ranks`` sets
    NUM_PROC_PER_NODE over the NUM_NODES set by then; a name that is not a knob is a dotted
    config key (``DISTRIBUTED.NUM_NODES``, ``MODEL.FSDP_CONFIG.AUTO_SETUP_FSDP``)."""
    out = copy.deepcopy(cfg)
    out.defrost()
    for name, value in knobs.items():
        if name == "ranks":
            out.DISTRIBUTED.NUM_PROC_PER_NODE = math.ceil(value / out.DISTRIBUTED.NUM_NODES)
        else:
            set_key(out, KNOB_KEYS.get(name, name), value)
    out.freeze()
    return out


def ranked(settings: Sequence[Dict[str, object]], peaks: Sequence[float], device: str):
    """``[(knobs, planned peak bytes)]`` fastest first; equal speed: the smaller peak first, then
    the order of ``settings`` (preferred values first)."""
    order = sorted(
        range(len(settings)), key=lambda i: (round(speed_cost(settings[i], device), 6), peaks[i], i)
    )
    return [(settings[i], peaks[i]) for i in order]


def search(
    cfg,
    budget_mib: float,
    device: str = "cpu",
    max_ranks: Optional[int] = None,
    step_in_backward: Optional[bool] = None,
) -> Tuple[Optional[Dict[str, object]], MemoryPlan]:
    """The fastest setting of every knob, result knobs included, whose plan fits ``budget_mib``:
    (knobs, plan), or (None, the smallest plan reached). Fewer ranks and a larger batch per
    replica are tried first; ``step_in_backward`` True/False fixes that knob. The config is read
    once per (ranks, batch): every other knob is a setting of that :class:`RunShape`."""
    world = cfg.DISTRIBUTED.NUM_NODES * cfg.DISTRIBUTED.NUM_PROC_PER_NODE
    ranks = [world * 2**i for i in range(8) if world * 2**i <= (max_ranks or world)]
    batch = cfg.DATA.TRAIN.BATCHSIZE_PER_REPLICA
    batches = [b for b in (batch, batch // 2, batch // 4) if b >= 1]
    sharded = {"MODEL.FSDP_CONFIG.AUTO_SETUP_FSDP": True}
    if step_in_backward is not None:
        sharded["step_in_backward"] = step_in_backward
    fixed = ("step_in_backward",) if step_in_backward is not None else ()
    smallest, shapes = None, ModelShapes(cfg.MODEL, loss_cfg=cfg.LOSS)
    for r, b in itertools.product(ranks, batches):
        shape = run_shape(with_knobs(cfg, {**sharded, "batch_per_replica": b, "ranks": r}), shapes)
        settings = [
            {**knobs, "mixed_precision": mixed}
            for mixed in (False, True)
            for knobs in exact_settings(shape, device, fixed)
        ]
        plans = [plan(shape.with_knobs(knobs), device) for knobs in settings]
        settings = [{**knobs, "batch_per_replica": b, "ranks": r} for knobs in settings]
        by_setting = {tuple(knobs.items()): p for knobs, p in zip(settings, plans)}
        for knobs, peak in ranked(settings, [p.peak for p in plans], device):
            if smallest is None or peak < smallest[1].peak:
                smallest = (knobs, by_setting[tuple(knobs.items())])
            if peak <= budget_mib * MIB:
                return knobs, by_setting[tuple(knobs.items())]
    return None, smallest[1]


def overrides(knobs: Dict[str, object], nodes: int = 1) -> List[str]:
    """``config.X=Y`` arguments applying ``knobs``."""
    out = ["config.MODEL.FSDP_CONFIG.AUTO_SETUP_FSDP=True"]
    for name, value in knobs.items():
        if name == "ranks":
            out.append(f"config.DISTRIBUTED.NUM_PROC_PER_NODE={math.ceil(value / nodes)}")
        elif name in KNOB_KEYS:
            out.append(f"config.{KNOB_KEYS[name]}={value}")
    return out


def set_key(cfg, key: str, value) -> None:
    *parents, last = key.split(".")
    for part in parents:
        cfg = cfg[part]
    cfg[last] = value
