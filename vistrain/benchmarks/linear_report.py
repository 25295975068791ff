"""What linear evaluation (and fine-tuning) prints and writes: a header, one line per training pass
(each cross-validation fold, then the final fit) with the time left for the whole job, a compact
table of the results, and metrics.json in one form for both.

Every pass trains ``num_epochs`` epochs; their iterations are known before the first one starts,
so the ETA is (time so far / iterations done) x iterations left over the whole job, not over the
pass in progress. The meter's periodic lines (loss, lr, images/s) go to ``log.txt``,
``metrics.jsonl`` and TensorBoard only.
"""

import datetime
import time
from typing import Dict, List, Optional, Sequence

from vistrain.benchmarks import common, lr_grid
from vistrain.config.words import plural
from vistrain.distributed import comm
from vistrain.runtime.logger import logger


class JobClock:
    """Time spent and left in a job of ``total_iterations`` iterations (all passes together)."""

    def __init__(self, total_iterations: int):
        self.total = total_iterations
        self.start = time.perf_counter()

    def elapsed(self) -> str:
        return _clock(time.perf_counter() - self.start)

    def eta(self, done: int) -> str:
        """Time left once ``done`` of the job's iterations are done."""
        spent = time.perf_counter() - self.start
        return _clock(spent / max(done, 1) * max(self.total - done, 0))


def _clock(seconds: float) -> str:
    return str(datetime.timedelta(seconds=int(seconds)))


def header(names: Sequence[str], dims: Dict[str, int], num_classes: int, epochs: int, iters: int, world: int):
    """The first line: what is evaluated, and how long the final fit is."""
    shown = ", ".join(f"{name} ({dims[name]})" for name in names)
    return (
        f"linear evaluation of {shown}, {plural(num_classes, 'class', 'classes')}: "
        f"{plural(epochs, 'epoch')} x {plural(iters, 'iteration')} on {plural(world, 'rank')}"
    )


def grid_plan(grid: List[float], folds: int, fraction: float) -> str:
    """How each feature's learning rate is chosen (the second line, with a grid)."""
    how = (
        f"{folds}-fold cross-validation on DATA.TRAIN ({folds} folds, then the final fit)"
        if folds > 1
        else f"a held-out {fraction:.0%} of DATA.TRAIN (one fit on the rest, then the final fit)"
    )
    return f"choosing each feature's lr among {', '.join(f'{lr:g}' for lr in grid)} by {how}"


def fold_line(fold: int, folds: int, results: Dict[str, dict], names, grid, clock: JobClock, done: int):
    """After a fold (or the single holdout): each feature's best held-out top-1 and its lr."""
    best = []
    for name in names:
        top1, lr = max((results[lr_grid.grid_key(name, i)]["top1"], -lr) for i, lr in enumerate(grid))
        best.append(f"{name} {top1:.1f}% (lr {-lr:g})")
    which = f"fold {fold}/{folds}" if folds > 1 else "holdout fit"
    return f"{which} done ({clock.elapsed()}): best held-out top-1 {', '.join(best)}; eta {clock.eta(done)}"


def results_table(title: str, results: Dict[str, dict], with_grid: bool) -> List[str]:
    """The final table: one header line, one line per feature (``top1_<n>class`` columns too)."""
    grouped = [key for key in next(iter(results.values())) if key.startswith("top1_")]
    columns = f"  {'feature':<12}{'dim':>7}" + (f"{'lr':>8}{'held-out':>10}" if with_grid else "")
    lines = [title, f"{columns}{'top-1':>9}{'top-5':>9}" + "".join(f"{k[5:]:>9}" for k in grouped)]
    for name, res in results.items():
        grid = f"{res['lr']:>8g}{res['holdout_top1']:>9.2f}%" if with_grid else ""
        extra = "".join(f"{res[k]:>8.2f}%" for k in grouped)
        lines.append(f"  {name:<12}{res['dim']:>7}{grid}{res['top1']:>8.2f}%{res['top5']:>8.2f}%{extra}")
    return lines


def picked_feature(results: Dict[str, dict]) -> str:
    """The feature a user would pick without looking at the test set: the highest held-out top-1 of
    the lr grid's cross-validation on TRAIN (ties: the first listed); without a grid, the first."""
    names = list(results)
    return max(names, key=lambda n: (results[n].get("holdout_top1", 0.0), -names.index(n)))


def log_lines(lines: Sequence[str]) -> None:
    for line in lines:
        logger.info(line)


def with_choices(results: Dict[str, dict], dims: Dict[str, int], lrs: dict, selection: Optional[dict]):
    """Each feature's test results with its width and, after an lr grid, its lr and held-out top-1."""
    for name, result in results.items():
        result["dim"] = dims[name]
        if selection is not None:
            result.update(lr=lrs[name], holdout_top1=selection[name])
    return results


def record(cfg, engine: str, results: Dict[str, dict], extra: dict, times) -> dict:
    """metrics.json of an evaluation: what was evaluated, ``results`` per feature, the feature
    :func:`picked_feature` picks, ``extra`` ({"num_classes", "iterations"[, "epochs"]...}) and the
    seconds spent (``times``: (the job's start, seconds until the test pass))."""
    start, train_seconds = times
    picked = picked_feature(results)
    return {
        "engine": engine,
        "weights": cfg.MODEL.WEIGHTS_INIT.PARAMS_FILE,
        "weights_from": cfg.BENCHMARK.WEIGHTS_FROM,
        "epochs": cfg.OPTIMIZER.num_epochs,
        **extra,
        "world_size": comm.get_world_size(),
        "results": results,
        "picked": {"feature": picked, **results[picked]},  # by cross-validation on TRAIN, not by TEST
        "train_seconds": train_seconds,
        "total_seconds": time.perf_counter() - start,
    }


def report(run_dir: str, record: dict, writer, what: str) -> None:
    """Log ``what``'s table, TensorBoard scalars (rank 0's ``writer``: ``<engine>/<feature>/<metric>``)
    and metrics.json."""
    weights = record["weights"] or "random init"
    results = record["results"]
    first = next(iter(results.values()))
    title = f"{what} on DATA.TEST ({weights}, {plural(first['num_images'], 'image')}):"
    log_lines(results_table(title, results, "lr" in first))
    picked = record["picked"]
    if len(results) > 1:
        how = (
            "by the held-out top-1 on TRAIN" if "holdout_top1" in picked else "(no held-out score: the first)"
        )
        logger.info(
            f"picked {how}: {picked['feature']}, top-1 {picked['top1']:.2f}%"
            + "".join(f", {k} {v:.2f}%" for k, v in picked.items() if k.startswith("top1_"))
        )
    if writer is not None:
        for name, res in results.items():
            for metric in [k for k in res if k.startswith("top")]:
                writer.add_scalar(f"{record['engine']}/{name}/{metric}", res[metric], record["iterations"])
        writer.flush()
    logger.info(f"wrote {common.write_metrics(run_dir, record)}")
