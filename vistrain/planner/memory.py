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
                    inputs of the checkpointed modules plus the largest one's own activations;
                    plus what the method's loss holds at its peak (``Method.loss_memory``, e.g.
                    LeJEPA's (V, N, M, K) characteristic-function arguments)
    teacher params  a method with a momentum teacher (``Method.teacher``): the teacher is built and wrapped
                    like the student, so its shards are another ``params`` (no gradients, no
                    optimizer state); its forward runs under no_grad, resharding each unit after it
                    and saving no activations, before the student's, so it adds nothing at the peak
    runtime         CPU: RSS of a fresh Python process after importing the training stack (measured
                    once per planner run) + ``CPU_ALLOWANCE_MIB`` for the process group, loader
                    and allocator + (sharded, glibc's default) the all-gather buffers gloo's
                    worker threads keep in their own heaps (:func:`gather_arena_bytes`); CUDA: 0
                    (the CUDA context is not allocated memory)

On CPU the plan is for glibc's default allocator: the engine gives freed heap pages back at unit
boundaries (``vistrain/fsdp/model_state.py``) and ``GRADIENT_COPIES`` holds what glibc keeps until the
next trim. How the main heap fragments between trims beyond that is not modelled (ResNet-18 and the
ViT keep 45-110 MiB more at their peaks; docs/limitations.md). The measurements the terms were fitted to and checked against: docs/notes/memory.md.

``move_params_to_cpu`` on CUDA moves params, grads and optimizer state out of GPU memory.
Which knobs fit a budget and which of them is fastest: ``knobs.py`` and ``auto_tune.py``.
"""

import functools
import subprocess
import sys
from dataclasses import asdict, dataclass
from typing import Dict, Sequence, Tuple

from vistrain.fsdp.flat_param import shard_size
from vistrain.planner.shape import MIB, RunShape, meta_crops

# gloo threads and buffers, data loader, glibc arenas: what the quick start's peak RSS holds beyond
# the import baseline and its model terms (docs/notes/memory.md)
CPU_ALLOWANCE_MIB = 75
# A forked rank starts without the file-backed pages its imports mapped (see forked_ranks) and
# faults in the library code it runs: 15-60 MiB over the cases of dev/bench/bench_planner.py that run
# here (2 and 4 ranks) and the 2-rank test; 42 keeps them within 10%, but for RegNetY-3.2GF with
# AdamW and checkpointing, 11% under (6% with spawned ranks; docs/notes/memory.md)
FORKED_LIBRARY_MIB = 42
# A unit's full gradient at its backward peak: per parameter, concatenated, and half of it again
# for what glibc keeps until the next trim (fitted at glibc's default, docs/notes/memory.md).
GRADIENT_COPIES = 2.5
# With MACHINE.CPU_MMAP_THRESHOLD_MIB set glibc keeps nothing freed: the two copies autograd holds
GRADIENT_COPIES_MMAPPED = 2.0
# Worker threads of one gloo process group (ProcessGroupGloo's default ``threads``): each runs
# collectives with its own glibc heap (arena)
GLOO_WORKER_THREADS = 2
# glibc's mmap threshold climbs to the largest mapped block freed, at most this (64-bit
# DEFAULT_MMAP_THRESHOLD_MAX): larger blocks are always mapped and unmapped when freed
GLIBC_MMAP_THRESHOLD_MAX = 32 * MIB


@dataclass
class MemoryPlan:
    """Bytes per rank by component; ``peak`` is their sum."""

    params: float
    grads: float
    optimizer_state: float
    gathered_units: float
    activations: float
    runtime_overhead: float
    teacher_params: float = 0.0  # a momentum teacher's shards (DINO, BYOL); 0 without one

    @property
    def peak(self) -> float:
        return sum(asdict(self).values())

    def as_mib(self) -> Dict[str, float]:
        out = {"peak_mib_per_rank": round(self.peak / MIB, 1)}
        out["breakdown_mib"] = {k: round(v / MIB, 1) for k, v in asdict(self).items()}
        return out


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


def plan(shape: RunShape, device: str = "cpu") -> MemoryPlan:
    """Peak memory per rank of a training run of ``shape`` on ``device`` ("cpu" or "cuda"): the
    larger of the worst moment of backward and (the ordinary step) the moment after it."""
    state = sharded_state_bytes(
        shape.unit_sizes, shape.groups.shard_ranks, shape.optimizer_states, shape.sharded
    )
    all_grads = state["grads"]
    state["teacher_params"] = state["params"] if shape.teacher else 0
    if device == "cuda" and shape.sharded and shape.move_params_to_cpu:
        state = dict.fromkeys(state, 0)
    gathered = 0
    if shape.sharded:
        gathered, state["grads"] = _backward_moment(shape, device)
    runtime = runtime_bytes(shape, device) + gather_arena_bytes(shape, device)
    backward_peak = MemoryPlan(
        gathered_units=gathered,
        activations=activation_bytes(shape) + shape.loss_memory,
        runtime_overhead=runtime,
        **state,
    )
    if not shape.sharded or shape.step_in_backward:
        return backward_peak
    # the ordinary step, after backward: every shard gradient, one update temporary, no weights
    # gathered and the activations freed
    temporary = max(shard_size(n, shape.groups.shard_ranks) for n in shape.unit_sizes) * 4
    step_peak = MemoryPlan(**{**state, "grads": all_grads + temporary}, gathered_units=0,
                           activations=0, runtime_overhead=runtime)  # fmt: skip
    return max(backward_peak, step_peak, key=lambda plan: plan.peak)


def _backward_moment(shape: RunShape, device: str) -> Tuple[int, int]:
    """:func:`backward_peak_bytes` with ``shape``'s knobs."""
    mmapped = device == "cpu" and shape.cpu_mmap_threshold_mib > 0
    return backward_peak_bytes(
        shape.unit_sizes, shape.groups.shard_ranks, shape.precision.compute_bytes,
        shape.precision.reduce_bytes, shape.reshard_after_forward, shape.step_in_backward,
        shape.prefetch_depth, GRADIENT_COPIES_MMAPPED if mmapped else GRADIENT_COPIES,
    )  # fmt: skip


def activation_bytes(shape: RunShape) -> float:
    """Autograd's saved bytes of one forward (halved in 16 bits) plus the batch itself."""
    total, per_module, inputs = shape.model.activations(shape.crops, shape.batch, shape.checkpointed)
    saved = checkpointed_activations(total, per_module, inputs) * (0.5 if shape.precision.low else 1.0)
    return saved + sum(c.numel() * 4 for c in meta_crops(shape.crops, shape.batch, shape.model.channels))


def runtime_bytes(shape: RunShape, device: str) -> float:
    """CPU: the import baseline plus ``CPU_ALLOWANCE_MIB``; CUDA: 0."""
    if device != "cpu":
        return 0
    forked = forked_ranks(shape.spawns_ranks, device)
    baseline = shape.model.baseline_mib or import_baseline_mib(forked)
    return (baseline + CPU_ALLOWANCE_MIB + (FORKED_LIBRARY_MIB if forked else 0)) * MIB


def gather_arena_bytes(shape: RunShape, device: str) -> int:
    """CPU, sharded, glibc's default threshold: the all-gather buffers gloo's workers keep.

    gloo's list all-gather stages through one flat buffer of the full unit (W * ceil(n / W)
    elements of the compute dtype, W = shard ranks) that the gather group's worker thread allocates
    and frees in its own arena; the arena keeps the pages until the engine's next trim and reuses
    them for every smaller unit. So each of the ``GLOO_WORKER_THREADS`` workers holds the largest
    unit's buffer below ``GLIBC_MMAP_THRESHOLD_MAX`` (ResNet-18, 2 ranks: two arenas of 18.3 MiB at
    the peak, docs/notes/memory.md). A momentum teacher gathers through its own group. With the
    threshold fixed (``MACHINE.CPU_MMAP_THRESHOLD_MIB``) buffers above it are mapped and go back
    when freed; the arenas held 1-2 MiB then.
    """
    if device != "cpu" or not shape.sharded or shape.groups.shard_ranks == 1:
        return 0
    if shape.cpu_mmap_threshold_mib > 0:
        return 0
    world = shape.groups.shard_ranks
    buffers = [world * shard_size(n, world) * shape.precision.compute_bytes for n in shape.unit_sizes]
    largest = max((b for b in buffers if b < GLIBC_MMAP_THRESHOLD_MAX), default=0)
    groups = 2 if shape.teacher else 1
    return groups * GLOO_WORKER_THREADS * largest


def forked_ranks(spawns_ranks: bool, device: str) -> bool:
    """Whether the command line's launcher forks a run's ranks (``spawns_ranks``: it starts
    several on this node, ``shape.spawns_ranks``; on CPU, Linux: ``vistrain.distributed.spawn``).
    A forked rank holds of the launcher's pages only its anonymous memory and the library pages
    it touches, not every page the imports mapped in."""
    return device == "cpu" and spawns_ranks and sys.platform.startswith("linux")


def import_baseline_mib(forked: bool = False) -> float:
    """RSS of a fresh Python process that imported what a training rank imports (MiB); its
    anonymous part only for ``forked`` ranks (see :func:`forked_ranks`)."""
    return _import_rss_mib()[forked]


@functools.lru_cache(maxsize=1)
def _import_rss_mib() -> Tuple[float, float]:
    """(RSS, anonymous RSS) of a fresh process after ``import torch, torchvision, vistrain.jobs``."""
    code = (
        "import torch, torchvision, vistrain.jobs\n"
        "from vistrain.fsdp.memory import current_rss_mib\n"
        "print(current_rss_mib(), current_rss_mib(anonymous_only=True))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    total, anonymous = out.stdout.strip().splitlines()[-1].split()
    return float(total), float(anonymous)
