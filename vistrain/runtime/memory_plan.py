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
Which knobs fit a budget and which of them is fastest: ``knob_search.py`` and ``auto_tune.py``.
"""

import functools
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
# A unit's full gradient at its backward peak: per parameter, concatenated, and half of it again
# for what glibc keeps until the next trim (fitted at glibc's default, docs/memory.md).
GRADIENT_COPIES = 2.5
# With MACHINE.CPU_MMAP_THRESHOLD_MIB set glibc keeps nothing freed: the two copies autograd holds
GRADIENT_COPIES_MMAPPED = 2.0


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
    sizes: Sequence[int],
    world: int,
    compute_bytes: int,
    reduce_bytes: int,
    reshard: bool,
    in_backward: bool,
    prefetch_depth: int = 1,
    gradient_copies: float = None,
) -> Tuple[int, int]:
    """(gathered, gradients) bytes per rank at the worst unit of backward.

    ``sizes``: units in execution order, root last; backward visits them last to first. In the
    backward of unit k the root, unit k and the ``prefetch_depth`` units prefetched before it
    (k-1, k-2, ...) are gathered (ZeRO-2: every unit), and unit k's gradient exists
    ``gradient_copies`` times (default ``GRADIENT_COPIES``: autograd's split backward holds it
    per parameter and concatenated; glibc keeps some of what the unit freed until the next trim).
    Shard gradients alive then: those of the units already reduced (after k in execution order);
    with the optimizer step inside backward only the shard being updated (unit k+1's) and one
    update temporary of its size. The root's gradient completes last: the root gathered, its
    gradient ``gradient_copies`` times, every unit's shard gradient (the step in backward: one).
    """
    copies = GRADIENT_COPIES if gradient_copies is None else gradient_copies
    root, units = sizes[-1], list(sizes[:-1]) or [0]
    shards = [shard_size(n, world) * 4 for n in units] + [0]
    best = (0, 0)
    for k, size in enumerate(units):
        prefetched = sum(units[max(k - prefetch_depth, 0) : k])
        weights = root + (size + prefetched if reshard else sum(units))
        gathered = int(weights * compute_bytes + copies * size * reduce_bytes)
        grads = 2 * shards[k + 1] if in_backward else sum(shards[k + 1 :])
        if gathered + grads > sum(best):
            best = (gathered, grads)
    # the root's own gradient completes last, every other unit freed and reduced by then
    reduced = [shard_size(n, world) * 4 for n in sizes[:-1]]
    gathered = int(root * compute_bytes + copies * root * reduce_bytes)
    grads = 2 * max(reduced, default=0) if in_backward else sum(reduced)
    return max(best, (gathered, grads), key=sum)


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
    the same model (the knob search); ``cache["baseline_mib"]``, when set, is the import baseline
    (the launcher's own RSS: it imported what a rank imports), else it is measured."""
    cache = {} if cache is None else cache
    model_cfg, fsdp = cfg.MODEL, cfg.MODEL.FSDP_CONFIG
    world = cfg.DISTRIBUTED.NUM_NODES * cfg.DISTRIBUTED.NUM_PROC_PER_NODE
    sharded = bool(fsdp.AUTO_SETUP_FSDP)
    low = bool(sharded and fsdp.mixed_precision or model_cfg.AMP_PARAMS.USE_AMP)
    if "model" not in cache:
        cache["model"] = build_meta_model(model_cfg)
    model = cache["model"]
    sizes_key = ("sizes", sharded, low, fsdp.wrap_granularity)
    if sharded and sizes_key not in cache:
        policy = wrap_policy(low, fsdp.wrap_granularity)
        cache[sizes_key] = unit_sizes(model, lambda m: policy(m) is not None)
    sizes = cache[sizes_key] if sharded else [sum(p.numel() for p in model.parameters())]
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
        mmapped = device == "cpu" and cfg.MACHINE.CPU_MMAP_THRESHOLD_MIB > 0
        copies = GRADIENT_COPIES_MMAPPED if mmapped else GRADIENT_COPIES
        gathered, state["grads"] = backward_peak_bytes(
            sizes, shard_ranks, compute, reduce, fsdp.reshard_after_forward, in_backward,
            fsdp.prefetch_depth, copies,
        )  # fmt: skip
    checkpointing = model_cfg.ACTIVATION_CHECKPOINTING
    granularity = checkpointing.GRANULARITY if checkpointing.USE_ACTIVATION_CHECKPOINTING else None
    crops = _meta_crops(cfg.DATA.TRAIN, cfg.DATA.TRAIN.BATCHSIZE_PER_REPLICA)
    key = ("activations", cfg.DATA.TRAIN.BATCHSIZE_PER_REPLICA, granularity)
    if key not in cache:
        cache[key] = measure_activations(model, crops, granularity)
    total, per_module, inputs = cache[key]
    activations = checkpointed_activations(total, per_module, inputs) * (0.5 if low else 1.0)
    activations += sum(c.numel() * 4 for c in crops)  # the batch itself
    baseline = cache.get("baseline_mib") or import_baseline_mib() if device == "cpu" else 0
    runtime = (baseline + CPU_ALLOWANCE_MIB) * MIB if device == "cpu" else 0
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
