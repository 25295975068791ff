"""Predict a run's peak memory per rank from its config, and search the knobs for a budget.

What the run logs as ``mem`` (CPU: peak RSS of the process; CUDA: peak allocated memory) is
modelled as the sum of, per rank (bytes; W ranks, a unit of n elements has shards of
ceil(n / W) elements, p = fp32 master bytes 4, c = compute bytes: 2 under mixed precision):

    params          sum_u ceil(n_u / W) * 4            (DDP: sum_u n_u * 4)
    optimizer       k * params, k = 1 (SGD/LARS momentum), 2 (AdamW), 0 (SGD without momentum)
    gathered units  backward of unit k (execution order): c * (root + w_k + w_(k-1) prefetched)
                    (ZeRO-2: c * all units) + ``GRADIENT_COPIES`` * reduce bytes * g_k
    grads           the shard gradients alive then: of the units reduced before k; with the step
                    inside backward, the shard being updated and one temporary (DDP: every
                    gradient twice: .grad and its bucket); the worst k of gathered + grads
                    (:func:`backward_peak_bytes`). The ordinary step after backward holds every
                    shard gradient and no gathered weights: the plan is the larger of the two.
    activations     bytes autograd saves in one forward, measured on the meta device (scaled to
                    2 bytes under mixed precision / AMP); with activation checkpointing the
                    inputs of the checkpointed modules plus the largest one's own activations
    runtime         CPU: RSS of a fresh Python process after importing the training stack (measured
                    once per planner run) + ``CPU_ALLOWANCE_MIB`` for the process group, loader
                    and allocator; CUDA: 0 (the CUDA context is not allocated memory)

On CPU the plan is for glibc's default allocator: the engine gives freed heap pages back at unit
boundaries (``vistrain/fsdp/heap.py``) and ``GRADIENT_COPIES`` holds what glibc keeps until the
next trim. The measurements the terms were fitted to and checked against: docs/memory.md.

``move_params_to_cpu`` on CUDA moves params, grads and optimizer state out of GPU memory.
The search in :func:`search` tries the knobs in order of expected speed (see ``speed_cost``).
"""

import copy
import functools
import itertools
import math
import subprocess
import sys
from dataclasses import asdict, dataclass
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch
from torch import nn
from torchvision.models.regnet import AnyStage, ResBottleneckBlock

from vistrain.fsdp.flat_param import shard_size
from vistrain.models import build_meta_model
from vistrain.runtime.sharding import wrap_policy
from vistrain.torch_compat import storage_id

MIB = 2**20
# gloo threads and buffers, data loader, glibc arenas: what the quick start's peak RSS holds beyond
# the import baseline and its model terms (docs/memory.md)
CPU_ALLOWANCE_MIB = 75
OPTIMIZER_STATES = {"sgd": 1, "lars": 1, "adamw": 2}
# A fixed glibc mmap threshold (MACHINE.CPU_MMAP_THRESHOLD_MIB) costs this per step (page faults;
# dev/bench_host_memory.py, docs/memory.md); the search leaves it to the user
CPU_THRESHOLD_COST = 1.27
# The optimizer step inside backward: the same work, steps run shard by shard (dev/bench_fsdp.py,
# "step in bwd" row, within noise of the ordinary step); ranked just after it when both fit.
IN_BACKWARD_COST = 1.01
# A unit's full gradient at its backward peak: per parameter, concatenated, and half of it again
# for what glibc keeps until the next trim (fitted at glibc's default, docs/memory.md).
GRADIENT_COPIES = 2.5


@dataclass
class MemoryPlan:
    """Bytes per rank by component; ``peak`` is their sum."""

    params: float
    grads: float
    optimizer_state: float
    gathered_units: float
    activations: float
    runtime_overhead: float

    @property
    def peak(self) -> float:
        return sum(asdict(self).values())

    def as_mib(self) -> Dict[str, float]:
        out = {"peak_mib_per_rank": round(self.peak / MIB, 1)}
        out["breakdown_mib"] = {k: round(v / MIB, 1) for k, v in asdict(self).items()}
        return out


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


def sharded_state_bytes(
    sizes: Sequence[int], world: int, states: int, sharded: bool = True
) -> Dict[str, int]:
    """params / grads / optimizer state bytes per rank (fp32 masters) for units of ``sizes``."""
    elements = sum(shard_size(n, world) for n in sizes) if sharded else sum(sizes)
    grads = elements * 4 if sharded else 2 * elements * 4  # DDP: .grad plus its bucket copy
    return {"params": elements * 4, "grads": grads, "optimizer_state": states * elements * 4}


def backward_peak_bytes(
    sizes: Sequence[int], world: int, compute_bytes: int, reduce_bytes: int, reshard: bool, in_backward: bool
) -> Tuple[int, int]:
    """(gathered, gradients) bytes per rank at the worst unit of backward.

    ``sizes``: units in execution order, root last; backward visits them last to first. In the
    backward of unit k the root, unit k and the prefetched unit k-1 are gathered (ZeRO-2: every
    unit), and unit k's gradient exists ``GRADIENT_COPIES`` times (autograd's split backward
    holds it per parameter and concatenated; glibc keeps some of what the unit freed until the
    next trim). Shard gradients alive then: those of the units already reduced (after k in
    execution order); with the optimizer step inside backward only the shard being updated
    (unit k+1's) and one update temporary of its size.
    """
    root, units = sizes[-1], list(sizes[:-1]) or [0]
    shards = [shard_size(n, world) * 4 for n in units] + [0]
    best = (0, 0)
    for k, size in enumerate(units):
        before = units[k - 1] if k > 0 else 0
        weights = root + (size + before if reshard else sum(units))
        gathered = int(weights * compute_bytes + GRADIENT_COPIES * size * reduce_bytes)
        grads = 2 * shards[k + 1] if in_backward else sum(shards[k + 1 :])
        if gathered + grads > sum(best):
            best = (gathered, grads)
    return best


def checkpointed_activations(total: int, per_module: Sequence[int], inputs: Sequence[int]) -> int:
    """Saved bytes when each module of ``per_module`` is recomputed in backward: everything
    outside them, their inputs (kept by the checkpoint) and one module's own activations."""
    if not per_module:
        return total
    return total - sum(per_module) + sum(inputs) + max(per_module)


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

    targets = {"block": ResBottleneckBlock, "stage": AnyStage}.get(granularity or "", ())
    per_module, inputs, started_at = [], [], {}

    def pre(module, args):
        started_at[id(module)] = counter[0]
        inputs.append(sum(a.untyped_storage().nbytes() for a in args if isinstance(a, torch.Tensor)))

    def post(module, args, output):
        per_module.append(counter[0] - started_at[id(module)])

    handles = []
    for m in model.modules():
        if targets and isinstance(m, targets):
            handles += [m.register_forward_pre_hook(pre), m.register_forward_hook(post)]
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(crops)
    for h in handles:
        h.remove()
    return counter[0], per_module, inputs


def _meta_crops(data_cfg, batch: int) -> List[torch.Tensor]:
    transforms = data_cfg.TRANSFORMS
    return [
        torch.empty(batch, 3, size, size, device="meta")
        for count, size in zip(transforms.NUM_CROPS, transforms.SIZE_CROPS)
        for _ in range(count)
    ]


def plan(cfg, device: str = "cpu", cache: Optional[dict] = None) -> MemoryPlan:
    """Peak memory per rank of a training run of ``cfg`` on ``device`` ("cpu" or "cuda").

    ``cache`` (a dict) shares the meta model and activation measurements between plans of
    the same model (the knob search)."""
    cache = {} if cache is None else cache
    model_cfg, fsdp = cfg.MODEL, cfg.MODEL.FSDP_CONFIG
    world = cfg.DISTRIBUTED.NUM_NODES * cfg.DISTRIBUTED.NUM_PROC_PER_NODE
    sharded = bool(fsdp.AUTO_SETUP_FSDP)
    low = bool(sharded and fsdp.mixed_precision or model_cfg.AMP_PARAMS.USE_AMP)
    if "model" not in cache:
        cache["model"] = build_meta_model(model_cfg)
    model = cache["model"]
    if sharded:
        policy = wrap_policy(fp32_batchnorm=low)
        sizes = unit_sizes(model, lambda m: policy(m) is not None)
    else:
        sizes = [sum(p.numel() for p in model.parameters())]
    momentum = cfg.OPTIMIZER.momentum > 0 or cfg.OPTIMIZER.name == "adamw"
    states = OPTIMIZER_STATES.get(cfg.OPTIMIZER.name, 1) if momentum else 0
    shard_ranks = fsdp.shard_group_size or world  # hybrid sharding: shards over a group of k ranks
    state = sharded_state_bytes(sizes, shard_ranks, states, sharded)
    all_grads = state["grads"]
    if device == "cuda" and sharded and fsdp.move_params_to_cpu:
        state = dict.fromkeys(state, 0)
    compute = 2 if sharded and fsdp.mixed_precision else 4
    reduce = 4 if not (sharded and fsdp.mixed_precision) or fsdp.fp32_reduce_scatter else 2
    gathered = 0
    if sharded:
        in_backward = bool(cfg.OPTIMIZER.step_in_backward)
        gathered, state["grads"] = backward_peak_bytes(
            sizes, shard_ranks, compute, reduce, fsdp.reshard_after_forward, in_backward
        )
    checkpointing = model_cfg.ACTIVATION_CHECKPOINTING
    granularity = checkpointing.GRANULARITY if checkpointing.USE_ACTIVATION_CHECKPOINTING else None
    crops = _meta_crops(cfg.DATA.TRAIN, cfg.DATA.TRAIN.BATCHSIZE_PER_REPLICA)
    key = ("activations", cfg.DATA.TRAIN.BATCHSIZE_PER_REPLICA, granularity)
    if key not in cache:
        cache[key] = measure_activations(model, crops, granularity)
    total, per_module, inputs = cache[key]
    activations = checkpointed_activations(total, per_module, inputs) * (0.5 if low else 1.0)
    activations += sum(c.numel() * 4 for c in crops)  # the batch itself
    runtime = (import_baseline_mib() + CPU_ALLOWANCE_MIB) * MIB if device == "cpu" else 0
    backward_peak = MemoryPlan(
        gathered_units=gathered, activations=activations, runtime_overhead=runtime, **state
    )
    if not sharded or cfg.OPTIMIZER.step_in_backward:
        return backward_peak
    # the ordinary step, after backward: every shard gradient, one update temporary, no weights
    # gathered and the activations freed
    temporary = max(shard_size(n, shard_ranks) for n in sizes) * 4
    step_peak = MemoryPlan(**{**state, "grads": all_grads + temporary}, gathered_units=0,
                           activations=0, runtime_overhead=runtime)  # fmt: skip
    return max(backward_peak, step_peak, key=lambda plan: plan.peak)


@functools.lru_cache(maxsize=1)
def import_baseline_mib() -> float:
    """RSS of a fresh Python process that imported what a training rank imports (MiB)."""
    code = (
        "import torch, torchvision, vistrain.jobs\n"
        "from vistrain.fsdp.memory import current_rss_mib\n"
        "print(current_rss_mib())"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return float(out.stdout.strip().splitlines()[-1])


def speed_cost(knobs: Dict[str, object], device: str) -> float:
    """Relative time per image of a knob setting (lower is faster): ZeRO-3 gathers twice,
    checkpointing re-runs the forward, mixed precision speeds up GPUs only, CPU offload and the
    fixed mmap threshold cost transfers and page faults. Each factor and its source
    (``dev/bench_fsdp.py``, ``dev/bench_host_memory.py`` or common practice): docs/memory.md."""
    cost = 1.23 if knobs["reshard_after_forward"] else 1.0
    cost *= 1.33 if knobs["activation_checkpointing"] else 1.0
    # bf16 on CPU computes no faster here and changes the numbers: tried after the exact knobs
    cost *= (0.6 if device == "cuda" else 1.05) if knobs["mixed_precision"] else 1.0
    cost *= 1.5 if knobs.get("move_params_to_cpu") else 1.0
    cost *= CPU_THRESHOLD_COST if knobs.get("cpu_mmap_threshold_mib") else 1.0
    cost *= IN_BACKWARD_COST if knobs.get("step_in_backward") else 1.0
    return cost / knobs["ranks"]


def _with_knobs(cfg, knobs: Dict[str, object]):
    out = copy.deepcopy(cfg)
    out.defrost()
    fsdp = out.MODEL.FSDP_CONFIG
    fsdp.AUTO_SETUP_FSDP = True
    fsdp.reshard_after_forward = knobs["reshard_after_forward"]
    fsdp.mixed_precision = knobs["mixed_precision"]
    fsdp.move_params_to_cpu = knobs.get("move_params_to_cpu", False)
    if "cpu_mmap_threshold_mib" in knobs:
        out.MACHINE.CPU_MMAP_THRESHOLD_MIB = knobs["cpu_mmap_threshold_mib"]
    out.MODEL.ACTIVATION_CHECKPOINTING.USE_ACTIVATION_CHECKPOINTING = knobs["activation_checkpointing"]
    out.OPTIMIZER.step_in_backward = knobs.get("step_in_backward", False)
    out.DATA.TRAIN.BATCHSIZE_PER_REPLICA = knobs["batch_per_replica"]
    out.DISTRIBUTED.NUM_PROC_PER_NODE = knobs["ranks"] // out.DISTRIBUTED.NUM_NODES
    return out


def in_backward_choices(cfg, step_in_backward: Optional[bool] = None) -> tuple:
    """The step inside backward is exact, so the search may switch it on, unless the run needs
    every gradient first (global clipping, fp16 loss scaling); ``step_in_backward`` fixes it."""
    amp = cfg.MODEL.AMP_PARAMS
    if cfg.OPTIMIZER.clip_grad_norm > 0 or (amp.USE_AMP and amp.AMP_DTYPE == "float16"):
        return (bool(cfg.OPTIMIZER.step_in_backward),)
    return (False, True) if step_in_backward is None else (step_in_backward,)


def search(
    cfg,
    budget_mib: float,
    device: str = "cpu",
    max_ranks: Optional[int] = None,
    step_in_backward: Optional[bool] = None,
):
    """The fastest knob setting whose plan fits ``budget_mib``: (knobs, plan), or (None, the
    smallest plan reached). Fewer ranks and a larger batch per replica are tried first;
    ``step_in_backward`` True/False fixes that knob (None: the search may choose it)."""
    world = cfg.DISTRIBUTED.NUM_NODES * cfg.DISTRIBUTED.NUM_PROC_PER_NODE
    max_ranks = max_ranks or world
    ranks = [world * 2**i for i in range(8) if world * 2**i <= max_ranks]
    batch = cfg.DATA.TRAIN.BATCHSIZE_PER_REPLICA
    batches = [b for b in (batch, batch // 2, batch // 4) if b >= 1]
    offload = (False, True) if device == "cuda" else (False,)
    best, smallest, cache = None, None, {}
    for r, b in itertools.product(ranks, batches):
        settings = []
        for reshard, mixed, ckpt, cpu, in_backward in itertools.product(
            (False, True), (False, True), (False, True), offload, in_backward_choices(cfg, step_in_backward)
        ):
            knobs = dict(reshard_after_forward=reshard, mixed_precision=mixed, activation_checkpointing=ckpt,
                         move_params_to_cpu=cpu, step_in_backward=in_backward, batch_per_replica=b,
                         ranks=r)  # fmt: skip
            settings.append(knobs)
        for knobs in sorted(settings, key=lambda k: speed_cost(k, device)):
            result = plan(_with_knobs(cfg, knobs), device, cache)
            if smallest is None or result.peak < smallest[1].peak:
                smallest = (knobs, result)
            if result.peak <= budget_mib * MIB:
                best = (knobs, result)
                break
        if best is not None:
            return best
    return None, smallest[1]


def overrides(knobs: Dict[str, object], nodes: int = 1) -> List[str]:
    """``config.X=Y`` arguments applying ``knobs``."""
    machine = []
    if "cpu_mmap_threshold_mib" in knobs:
        machine = [f"config.MACHINE.CPU_MMAP_THRESHOLD_MIB={knobs['cpu_mmap_threshold_mib']}"]
    return machine + [
        "config.MODEL.FSDP_CONFIG.AUTO_SETUP_FSDP=True",
        f"config.MODEL.FSDP_CONFIG.reshard_after_forward={knobs['reshard_after_forward']}",
        f"config.MODEL.FSDP_CONFIG.mixed_precision={knobs['mixed_precision']}",
        f"config.MODEL.FSDP_CONFIG.move_params_to_cpu={knobs['move_params_to_cpu']}",
        f"config.MODEL.ACTIVATION_CHECKPOINTING.USE_ACTIVATION_CHECKPOINTING={knobs['activation_checkpointing']}",
        f"config.OPTIMIZER.step_in_backward={knobs.get('step_in_backward', False)}",
        f"config.DATA.TRAIN.BATCHSIZE_PER_REPLICA={knobs['batch_per_replica']}",
        f"config.DISTRIBUTED.NUM_PROC_PER_NODE={math.ceil(knobs['ranks'] / nodes)}",
    ]
