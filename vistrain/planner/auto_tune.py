"""``MODEL.FSDP_CONFIG.AUTO_TUNE``: the run picks its exact knobs from a plan of itself.

Before a training run starts its ranks, :func:`tune` plans every setting of the exact knobs
(``knobs.EXACT_KNOBS``: they never change the numbers) with the memory planner, ranks them
by measured speed (``knobs.speed_cost``) and takes the fastest whose planned peak per rank
fits the budget: ``MACHINE.MEMORY_BUDGET_MIB``, or with 0 what the machine has (CPU: the memory
available now shared by this node's ranks; CUDA: the device's memory), less ``MARGIN``. Knobs the
recipe or the command line set keep their value. A run resuming from a checkpoint keeps the knobs
its config.yaml recorded while they still fit. Results knobs (mixed precision, batch, ranks) are
never changed, only named when nothing fits, as what would make it fit.
"""

import contextlib
import os
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

import yaml

from vistrain.config import ConfigError
from vistrain.config.checks import get_key
from vistrain.config.words import plural
from vistrain.fsdp.collectives import shard_group_size_problem
from vistrain.fsdp.memory import current_rss_mib
from vistrain.planner.knobs import EXACT_KNOBS, current_knobs, exact_settings, speed_cost, with_knobs
from vistrain.planner.memory import forked_ranks, plan
from vistrain.planner.shape import MIB, ModelShapes, RunShape, run_shape, spawns_ranks

MARGIN = 0.10  # of the machine's memory, left for what the plan does not hold (page cache, spikes)
Setting = Dict[str, object]


@dataclass
class Budget:
    mib: float
    source: str  # how it was found, for the log line


@dataclass
class Choice:
    """What :func:`choose` found. Peaks are bytes per rank."""

    knobs: Optional[Setting]  # None: nothing fits
    peak: float  # of ``knobs``; when nothing fits, the smallest reachable peak
    smallest: Optional[Setting]  # the setting with the smallest peak (found when nothing fits)
    faster_rejected: Optional[Tuple[Setting, float]] = None  # the fastest setting that did not fit
    runner_up: Optional[Tuple[Setting, float]] = None  # the next fastest that fits


def choose(settings: Sequence[Setting], peaks: Sequence[float], budget_bytes: float, device: str) -> Choice:
    """The fastest of ``settings`` whose peak (same order) fits ``budget_bytes``; ties as
    :func:`knobs.ranked` (smaller peak, then the preferred values). ``peaks`` is read in speed
    order and only as far as the choice, a faster setting that did not fit and a runner-up need
    (:class:`LazyPeaks` plans each setting on first use); all of them when nothing fits."""
    fitting, first = [], None
    for group in speed_groups(settings, device):
        ordered = sorted(group, key=lambda i: (peaks[i], i))
        first = ordered[0] if first is None else first
        fitting += [i for i in ordered if peaks[i] <= budget_bytes]
        if len(fitting) >= 2:
            break
    if not fitting:
        smallest = min(range(len(settings)), key=lambda i: (peaks[i], i))
        return Choice(None, peaks[smallest], settings[smallest])
    best = fitting[0]
    faster = (settings[first], peaks[first]) if first != best else None
    runner_up = (settings[fitting[1]], peaks[fitting[1]]) if len(fitting) > 1 else None
    return Choice(settings[best], peaks[best], None, faster, runner_up)


def speed_groups(settings: Sequence[Setting], device: str) -> List[List[int]]:
    """Indices of ``settings`` grouped by equal speed (``knobs.speed_cost``), fastest first,
    each group in the settings' order."""
    groups: Dict[float, List[int]] = {}
    for i, knobs in enumerate(settings):
        groups.setdefault(round(speed_cost(knobs, device), 6), []).append(i)
    return [groups[cost] for cost in sorted(groups)]


class LazyPeaks:
    """Planned peak bytes of ``settings[i]`` (``shape`` with its knobs), planned on first use: a
    choice reads a handful of the hundreds of settings."""

    def __init__(self, shape: RunShape, settings: Sequence[Setting], device: str):
        self.shape, self.settings, self.device = shape, settings, device
        self.planned: Dict[int, float] = {}

    def __getitem__(self, i: int) -> float:
        if i not in self.planned:
            self.planned[i] = plan(self.shape.with_knobs(self.settings[i]), self.device).peak
        return self.planned[i]

    def __len__(self) -> int:
        return len(self.settings)


def machine_budget(device: str, ranks_on_node: int, device_index: int = 0) -> Budget:
    """What one rank may use: available memory now / ranks here (CPU) or the device's memory
    (CUDA), less ``MARGIN``."""
    if device == "cuda":
        import torch

        total = torch.cuda.get_device_properties(device_index).total_memory / MIB
        return Budget(total * (1 - MARGIN), f"{total:,.0f} MiB on the GPU less {MARGIN:.0%}")
    available = available_memory_mib()
    per_rank = available / max(ranks_on_node, 1)
    return Budget(
        per_rank * (1 - MARGIN),
        f"{available:,.0f} MiB available / {plural(ranks_on_node, 'rank')} here, less {MARGIN:.0%}",
    )


def available_memory_mib() -> float:
    """MemAvailable of /proc/meminfo (what can be allocated without swapping), else all memory."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / MIB


@dataclass
class Tuned:
    """What the launcher's tuning decided. ``across_nodes``: in a job that spans nodes with
    ``shard_group_size`` free, the fastest fitting ``(knobs, planned peak)`` for each shard group
    size, fastest by compute first; the ranks choose among them once they know the link
    (``across_nodes.choose_across_nodes``); ``layout``: the job's nodes and ranks as planned."""

    cfg: object  # with the chosen knobs (across nodes: the first candidate's until the ranks choose)
    line: str
    across_nodes: Tuple[Tuple[Setting, float], ...] = ()
    layout: Optional[Setting] = None
    fits: bool = True  # False: nothing fits (``refuse=False``): ``cfg`` has the smallest peak's knobs


def tune_job(cfg, argv: Sequence[str], launcher: bool = False) -> Tuned:
    """:func:`tune_settings` for the run ``argv`` describes, on this machine and its launcher's
    layout (torchrun's when it runs under torchrun). ``launcher``: this process is the run's
    launcher and has imported what a rank imports: its RSS is a rank's baseline (the anonymous
    part where it forks the ranks, ``memory.forked_ranks``), no subprocess needed."""
    from vistrain.config import explicit_keys
    from vistrain.distributed.launch import planned_world_size, resolve_device

    device = resolve_device(cfg.MACHINE)
    # torchrun / SLURM say how many ranks share this node
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", cfg.DISTRIBUTED.NUM_PROC_PER_NODE))
    if cfg.MACHINE.MEMORY_BUDGET_MIB > 0:
        budget = Budget(cfg.MACHINE.MEMORY_BUDGET_MIB, "MACHINE.MEMORY_BUDGET_MIB")
    else:
        budget = machine_budget(device, per_node)
    world = planned_world_size(cfg.DISTRIBUTED, os.environ)
    forked = forked_ranks(spawns_ranks(cfg.DISTRIBUTED), device)
    baseline_mib = current_rss_mib(anonymous_only=forked) if launcher else None
    return tune_settings(cfg, explicit_keys(argv), world, budget, device, baseline_mib, per_node)


def tune_settings(
    cfg,
    explicit: Sequence[str],
    world: int,
    budget: Budget,
    device: str,
    baseline_mib: Optional[float] = None,
    ranks_per_node: Optional[int] = None,
    refuse: bool = True,
    shapes: Optional[ModelShapes] = None,
) -> Tuned:
    """The config with the chosen knobs and the log line (:class:`Tuned`; across nodes also the
    candidates the ranks choose from); ConfigError (one line) when nothing fits, or with
    ``refuse=False`` the setting of the smallest peak and that line as ``Tuned.line``.

    ``explicit``: the dotted keys the recipe chain or the command line set (kept as set);
    ``world``: the job's ranks (the planner shards over them); ``baseline_mib``: the RSS of a
    process that imported what a rank imports (the launcher's own, before planning), else the
    planner measures one in a subprocess; ``ranks_per_node``: the job's (torchrun may decide it),
    else the config's; ``shapes``: the measurements of ``cfg.MODEL``, when the caller has them.
    The config is read once (its :class:`RunShape`); every setting is a setting of that shape.
    """
    planned = _for_world(cfg, world, ranks_per_node or cfg.DISTRIBUTED.NUM_PROC_PER_NODE)
    fixed = [name for name, key in EXACT_KNOBS.items() if key in explicit]
    shapes = shapes if shapes is not None else ModelShapes(cfg.MODEL, baseline_mib, cfg.LOSS)
    shape = run_shape(planned, shapes)
    settings = exact_settings(shape, device, fixed)
    peaks = LazyPeaks(shape, settings, device)
    choice = choose(settings, peaks, budget.mib * MIB, device)
    if choice.knobs is None:
        refusal = _refusal(planned, choice, budget, device, fixed, shapes)
        if refuse:
            raise ConfigError(refusal)
        return Tuned(with_knobs(cfg, choice.smallest), refusal, fits=False)
    kept, note = _replanned_for_world(_resumed_knobs(cfg, settings[0].keys(), fixed), choice.knobs, world)
    if kept is not None:
        peak = plan(shape.with_knobs(kept), device).peak
        if peak <= budget.mib * MIB:
            line = f"auto-tune: kept the resumed run's {_show(kept)} (planned {peak / MIB:,.0f} MiB"
            return Tuned(
                with_knobs(cfg, kept),
                f"{line} per rank, budget {budget.mib:,.0f} MiB: {budget.source}){note}",
            )
        note += f"; the resumed run's {_show(_changed(kept, choice.knobs))} no longer fits ({peak / MIB:,.0f} MiB)"
    line = _chosen_line(choice, budget, device, fixed) + note
    spans_nodes = shape.nodes > 1 and "shard_group_size" not in fixed
    candidates = _per_shard_group(settings, peaks, budget.mib * MIB, device) if spans_nodes else []
    if len(candidates) < 2:
        return Tuned(with_knobs(cfg, choice.knobs), line)
    shown = "; ".join(f"{_show(knobs)} ({peak / MIB:,.0f} MiB)" for knobs, peak in candidates)
    line = (
        f"auto-tune: the job spans nodes; fastest fitting setting per shard_group_size: {shown}; "
        f"budget {budget.mib:,.0f} MiB ({budget.source}). The ranks choose by the link's speed"
    )
    layout = {"DISTRIBUTED.NUM_NODES": planned.DISTRIBUTED.NUM_NODES, "ranks": world}
    return Tuned(with_knobs(cfg, candidates[0][0]), line, tuple(candidates), layout)


def _per_shard_group(settings, peaks, budget_bytes: float, device: str) -> List[Tuple[Setting, float]]:
    """The fastest fitting setting of every shard group size among ``settings``, fastest first
    (ties as :func:`choose`)."""
    sizes = {knobs["shard_group_size"] for knobs in settings if "shard_group_size" in knobs}
    best: Dict[object, Tuple[Setting, float]] = {}
    for group in speed_groups(settings, device):
        for i in sorted(
            (i for i in group if settings[i].get("shard_group_size") not in best), key=lambda i: (peaks[i], i)
        ):
            if peaks[i] <= budget_bytes and "shard_group_size" in settings[i]:
                best.setdefault(settings[i]["shard_group_size"], (settings[i], peaks[i]))
        if len(best) == len(sizes):
            break
    return list(best.values())


def summary_line(before, tuned, details: str) -> str:
    """The console's short line for a tuned run: the knobs that changed from ``before``'s
    (``details``, the line of :func:`tune`, goes to log.txt)."""
    if details.startswith("auto-tune: kept "):
        return "auto-tune: kept the resumed run's knobs, which still fit (details in log.txt)"
    changed = _changed(exact_knobs_of(tuned), exact_knobs_of(before))
    chose = _show(changed) if changed else "the knobs as configured"
    return f"auto-tune: {chose}, the fastest that fits the memory per rank (details in log.txt)"


def planned_settings(shape: RunShape, device: str, fixed: Sequence[str] = ()):
    """``(settings, planned peak bytes of each)``: every exact setting of ``shape`` with ``fixed`` kept."""
    settings = exact_settings(shape, device, fixed)
    return settings, [plan(shape.with_knobs(knobs), device).peak for knobs in settings]


def check_same_knobs(gathered: List[Setting]) -> None:
    """ConfigError unless every rank (``gathered``: each rank's exact knobs) runs the same ones:
    nodes that tuned for different budgets would build different units."""
    if any(knobs != gathered[0] for knobs in gathered[1:]):
        raise ConfigError(
            "ranks chose different knobs (AUTO_TUNE planned for different budgets per node): set "
            "MACHINE.MEMORY_BUDGET_MIB to the same value on every node"
        )


def exact_knobs_of(cfg) -> Setting:
    return current_knobs(cfg, list(EXACT_KNOBS))


# --------------------------------------------------------------------------------------------
# helpers


def _for_world(cfg, world: int, per_node: int):
    """``cfg`` planned for the ``world`` ranks, ``per_node`` on each node, that the job will run
    (torchrun may decide them)."""
    if world == cfg.DISTRIBUTED.NUM_NODES * cfg.DISTRIBUTED.NUM_PROC_PER_NODE:
        return cfg
    nodes = world // per_node if per_node and world % per_node == 0 else 1
    return with_knobs(cfg, {"DISTRIBUTED.NUM_NODES": nodes, "ranks": world})


def _resumed_knobs(cfg, names, fixed: Sequence[str]) -> Optional[Setting]:
    """The free knobs' values in the run folder's config.yaml when this run resumes from it."""
    from vistrain.checkpoint import find_latest_checkpoint

    path = os.path.join(cfg.CHECKPOINT.DIR, "config.yaml")
    if not (
        cfg.CHECKPOINT.AUTO_RESUME and os.path.isfile(path) and find_latest_checkpoint(cfg.CHECKPOINT.DIR)
    ):
        return None
    try:
        with open(path) as f:
            recorded = yaml.safe_load(f)
    except (OSError, yaml.YAMLError):
        return None  # the resume itself reports a broken folder
    knobs = current_knobs(cfg, list(names))
    for name in names:
        if name not in fixed:
            with contextlib.suppress(KeyError, TypeError):  # written before the knob existed
                knobs[name] = get_key(recorded, EXACT_KNOBS[name])
    return knobs


def _replanned_for_world(
    kept: Optional[Setting], chosen: Setting, world: int
) -> Tuple[Optional[Setting], str]:
    """``kept`` (the resumed run's knobs) with a ``shard_group_size`` that no longer divides the
    ``world`` of this run replaced by the one chosen now, and a note saying so ("" when none)."""
    size = (kept or {}).get("shard_group_size")
    if size is None or shard_group_size_problem(world, size) is None:
        return kept, ""
    again = chosen.get("shard_group_size", 0)
    note = (
        f"; the resumed run's shard_group_size={size} does not divide {world} ranks: "
        f"chose shard_group_size={again} again"
    )
    return {**kept, "shard_group_size": again}, note


def _show(knobs: Setting) -> str:
    """``name=value, ...``; the checkpointing granularity only where checkpointing is on."""
    shown = dict(knobs)
    if not shown.get("activation_checkpointing", True):
        shown.pop("checkpointing_granularity", None)
    return ", ".join(f"{name}={value}" for name, value in shown.items()) or "(same)"


def _changed(knobs: Setting, reference: Setting) -> Setting:
    return {name: value for name, value in knobs.items() if reference.get(name) != value}


def _chosen_line(choice: Choice, budget: Budget, device: str, fixed: Sequence[str]) -> str:
    free = {name: value for name, value in choice.knobs.items() if name not in fixed}
    line = (
        f"auto-tune: chose {_show(free)}; planned {choice.peak / MIB:,.0f} MiB per rank, "
        f"budget {budget.mib:,.0f} MiB ({budget.source})"
    )
    if fixed:
        line += f"; kept as set: {', '.join(fixed)}"
    if choice.faster_rejected is not None:
        knobs, peak = choice.faster_rejected
        line += f"; rejected the faster {_show(_changed(knobs, choice.knobs))}: planned {peak / MIB:,.0f} MiB"
    elif choice.runner_up is not None:
        knobs, peak = choice.runner_up
        slower = speed_cost(knobs, device) / speed_cost(choice.knobs, device)
        pace = f"{slower:.2f}x the step time" if slower > 1 else "as fast by the measured factors"
        line += f"; runner-up {_show(_changed(knobs, choice.knobs))}: {pace}, planned {peak / MIB:,.0f} MiB"
    return line


def _refusal(
    cfg, choice: Choice, budget: Budget, device: str, fixed: Sequence[str], shapes: ModelShapes
) -> str:
    """Nothing fits: the smallest reachable peak and the result knobs that would make it fit."""
    levers = []
    ranks = cfg.DISTRIBUTED.NUM_NODES * cfg.DISTRIBUTED.NUM_PROC_PER_NODE
    fsdp = cfg.MODEL.FSDP_CONFIG
    batch = cfg.DATA.TRAIN.BATCHSIZE_PER_REPLICA
    trials = [("ranks", ranks * f, f"{ranks * f} ranks") for f in (2, 4, 8)]
    trials += [
        ("batch_per_replica", batch // d, f"DATA.TRAIN.BATCHSIZE_PER_REPLICA={batch // d}") for d in (2, 4)
    ]
    if fsdp.AUTO_SETUP_FSDP and not fsdp.mixed_precision:
        trials.append(("mixed_precision", True, "MODEL.FSDP_CONFIG.mixed_precision=True"))
    elif not fsdp.AUTO_SETUP_FSDP:
        trials.append(("MODEL.FSDP_CONFIG.AUTO_SETUP_FSDP", True, "MODEL.FSDP_CONFIG.AUTO_SETUP_FSDP=True"))
    for name, value, text in trials:
        if name == "batch_per_replica" and value < 1:
            continue
        peak = _smallest_peak_with(cfg, name, value, device, fixed, shapes)
        if peak <= budget.mib * MIB:
            levers.append(f"{text} ({peak / MIB:,.0f} MiB)")
            if name == "ranks":
                break  # the fewest ranks that fit is enough
    advice = (
        "; it fits with " + " or ".join(levers)
        if levers
        else "; no single lever of ranks, batch or precision fits"
    )
    return (
        f"MODEL.FSDP_CONFIG.AUTO_TUNE: nothing fits the budget of {budget.mib:,.0f} MiB per rank "
        f"({budget.source}): the smallest reachable peak is {choice.peak / MIB:,.0f} MiB "
        f"({_show(_changed(choice.smallest, {}))}){advice}"
    )


def _smallest_peak_with(
    cfg, name: str, value, device: str, fixed: Sequence[str], shapes: ModelShapes
) -> float:
    """The smallest planned peak of the exact settings once result knob ``name`` is ``value``."""
    if name == "ranks":
        changed = with_knobs(cfg, {"DISTRIBUTED.NUM_NODES": 1, "ranks": value})
    else:
        changed = with_knobs(cfg, {name: value})
    return min(planned_settings(run_shape(changed, shapes), device, fixed)[1])
