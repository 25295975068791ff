"""What ``tools/plan_memory.py`` prints: a recipe's plan per rank, its knobs, and where it fits.

The plan comes from the config alone (shapes from the model built on the meta device and the
crops and batch of ``DATA.TRAIN``; no image is read, no data set need exist). With
``MODEL.FSDP_CONFIG.AUTO_TUNE`` on (the shipped recipes) the exact knobs are those the run would
choose for the budget it tunes for: ``MACHINE.MEMORY_BUDGET_MIB`` when set, else the named GPU
(``--gpu``), else this machine; when nothing fits, the setting of the smallest peak, said so.

:func:`planned_run` plans; :func:`report` turns it into the JSON of ``--json``;
:func:`table` into the text a person reads.
"""

import dataclasses
from typing import Dict, List, Optional, Sequence

from vistrain.config import ConfigError
from vistrain.config.words import plural
from vistrain.planner.auto_tune import MARGIN, Budget, machine_budget, tune_settings
from vistrain.planner.gpus import GPUS
from vistrain.planner.knobs import EXACT_KNOBS, exact_choices
from vistrain.planner.memory import MemoryPlan, plan
from vistrain.planner.shape import MIB, ModelShapes, RunShape, run_shape
from vistrain.planner.traffic import traffic

# rows of the memory table: MemoryPlan field -> what a person calls it
KINDS = {
    "params": "parameters (shards)",
    "grads": "gradients",
    "optimizer_state": "optimizer state",
    "gathered_units": "gathered units",
    "activations": "activations",
    "runtime_overhead": "runtime",
    "teacher_params": "momentum teacher",
}


def gpu_budget(name: str) -> Budget:
    """What one rank on the GPU ``name`` (a key of :data:`GPUS`) may use; ConfigError otherwise."""
    if name not in GPUS:
        raise ConfigError(f"unknown --gpu {name!r}; known: {', '.join(GPUS)}")
    total = GPUS[name]
    return Budget(total * (1 - MARGIN), f"{total:,.0f} MiB on the {name}, less {MARGIN:.0%}")


def this_machine_budget(device: str, ranks_on_node: int) -> Optional[Budget]:
    """This machine's memory per rank for a run on ``device`` (None: a CUDA plan, no GPU here)."""
    if device == "cuda":
        import torch

        if not torch.cuda.is_available():
            return None
    return machine_budget(device, ranks_on_node)


@dataclasses.dataclass
class PlannedRun:
    """A run's plan: its config with the knobs planned, memory and traffic per rank."""

    cfg: object
    shape: RunShape
    device: str
    memory: MemoryPlan
    sent: Dict[str, float]  # traffic per step and rank, MiB
    tuned_for: Optional[Budget] = None  # the budget the auto-tuner planned for
    tune_line: Optional[str] = None  # its line (or why nothing fits)
    tune_summary: Optional[str] = None  # the same, short, for the table
    tuned_fits: bool = True
    chosen: Sequence[str] = ()  # knobs the auto-tuner chose (not set by the recipe or command line)


def planned_run(cfg, device: str, budget: Optional[Budget], explicit: Sequence[str]) -> PlannedRun:
    """Plan ``cfg`` on ``device``; with AUTO_TUNE and a ``budget``, for the knobs the run would
    choose (``explicit``: the keys the recipe or command line set, kept)."""
    shapes = ModelShapes(cfg.MODEL, loss_cfg=cfg.LOSS)
    tuned, line, summary, fits, chosen = cfg, None, None, True, ()
    if cfg.MODEL.FSDP_CONFIG.AUTO_TUNE and budget is not None:
        world = cfg.DISTRIBUTED.NUM_NODES * cfg.DISTRIBUTED.NUM_PROC_PER_NODE
        result = tune_settings(cfg, explicit, world, budget, device, refuse=False, shapes=shapes)
        tuned, line, fits = result.cfg, result.line, result.fits
        chosen = [name for name, key in EXACT_KNOBS.items() if key not in explicit]
        summary = _tune_summary(result, budget)
    elif cfg.MODEL.FSDP_CONFIG.AUTO_TUNE:
        line = summary = (
            "auto-tune: no budget to plan for (a CUDA plan on a machine without a GPU): the recipe's "
            "knobs; name a GPU with --gpu"
        )
    shape = run_shape(tuned, shapes)
    sent = traffic(shape).as_mib()
    return PlannedRun(tuned, shape, device, plan(shape, device), sent, budget, line, summary, fits, chosen)


def _tune_summary(result, budget: Budget) -> str:
    """The auto-tuner's choice in one short line (its own line names every knob)."""
    if not result.fits:
        return f"{result.line}; shown: the setting of the smallest peak"
    summary = f"auto-tune: the fastest knobs (*) that fit {budget.mib:,.0f} MiB per rank ({budget.source})"
    if result.across_nodes:
        options = ", ".join(
            f"{knobs['shard_group_size']} ({peak / MIB:,.0f} MiB)" for knobs, peak in result.across_nodes
        )
        summary += f"; across nodes the ranks choose shard_group_size by the link's speed: {options}; shown: the first"
    return summary


def report(run: PlannedRun, name: str, places: Sequence[tuple]) -> dict:
    """The JSON of ``--json``: the plan, its knobs, and ``fits`` for each of ``places``
    (``(label, Budget or None, why there is none)``)."""
    out = {"config": name, "device": run.device, **_layout(run.shape)}
    if run.tune_line:
        out["auto_tune"] = run.tune_line
        out["auto_tune_summary"] = run.tune_summary
    out["knobs"] = _knobs(run.shape, run.device)
    out["chosen_by_auto_tune"] = [k for k in run.chosen if k in out["knobs"]]
    out.update(run.memory.as_mib())
    out["sent_per_step_per_rank"] = run.sent
    out["fits"] = {label: _fit(run.memory.peak, budget, why) for label, budget, why in places}
    return out


def table(out: dict) -> str:
    """``report``'s content as text: the run, its knobs, memory per rank by kind, where it fits."""
    lines = [
        f"{out['config']}: {out['ranks']} on {out['device']} ({out['nodes']}), {out['batch_per_rank']} images "
        f"per rank, crops {out['crops']}; {out['engine']}, {out['precision']}"
    ]
    if "auto_tune" in out:
        lines.append(out["auto_tune_summary"])
    lines += ["", "knobs" + (" (* chosen by the auto-tuner)" if out["chosen_by_auto_tune"] else "")]
    width = max(len(k) for k in out["knobs"])
    for knob, value in out["knobs"].items():
        mark = " *" if knob in out["chosen_by_auto_tune"] else ""
        lines.append(f"  {knob:<{width}}  {value}{mark}")
    lines += ["", f"  {'memory per rank':<22}{'MiB':>10}"]
    for kind, label in KINDS.items():
        lines.append(f"  {label:<22}{out['breakdown_mib'][kind]:>10,.1f}")
    lines.append(f"  {'peak':<22}{out['peak_mib_per_rank']:>10,.1f}")
    lines.append("")
    for label, fit in out["fits"].items():
        lines.append(f"fits {label}: {fit['answer']}")
    sent = out["sent_per_step_per_rank"]
    lines.append(
        f"sent per step and rank: {sent['shard_group_mib']:,.1f} MiB in the shard group, "
        f"{sent['replica_group_mib']:,.1f} MiB across groups; the busiest node link "
        f"{sent['cross_node_mib']:,.1f} MiB per rank"
    )
    if "predicted_step" in out:
        step = out["predicted_step"]
        lines.append(
            f"predicted step on a {step['link_gbps']:g} Gbit/s link: {step['seconds']:.3f} s "
            f"(compute {step['compute_s']:.3f} s)"
        )
    return "\n".join(lines)


def _fit(peak: float, budget: Optional[Budget], why: str) -> dict:
    if budget is None:
        return {"fits": None, "answer": why}
    fits = peak <= budget.mib * MIB
    answer = (
        f"{'yes' if fits else 'no'}: {peak / MIB:,.0f} MiB per rank planned, {budget.mib:,.0f} MiB per rank "
        f"there ({budget.source})"
    )
    return {"fits": fits, "budget_mib": round(budget.mib, 1), "source": budget.source, "answer": answer}


def _layout(shape: RunShape) -> dict:
    if shape.sharded and shape.mixed_precision:
        precision = f"{shape.compute_dtype} gathers and compute"
        precision += ", fp32 reductions" if shape.fp32_reduce_scatter else ""
    elif shape.amp:
        precision = f"{shape.amp_dtype} autocast"
    else:
        precision = "fp32"
    return {
        "ranks": plural(shape.world, "rank"),
        "nodes": f"{plural(shape.nodes, 'node')} x {shape.ranks_per_node}",
        "batch_per_rank": shape.batch,
        "crops": " + ".join(f"{count} x {side} px" for count, side in shape.crops),
        "engine": f"sharded ({shape.engine} engine)" if shape.sharded else "DDP",
        "precision": precision,
    }


def _knobs(shape: RunShape, device: str) -> Dict[str, object]:
    """The exact knobs that apply to ``shape`` on ``device`` and the result knobs, with their values."""
    names: List[str] = list(exact_choices(shape, device))
    knobs = shape.knobs(names + ["mixed_precision", "batch_per_replica", "ranks"])
    if not knobs.get("activation_checkpointing"):
        knobs.pop("checkpointing_granularity", None)
    knobs["mixed_precision"] = shape.sharded and shape.mixed_precision
    return knobs
