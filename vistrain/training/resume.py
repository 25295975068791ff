"""Resuming a training run from its folder: the most advanced readable checkpoint, on any
world size, with what a rank restores only when the world is the same (its RNG streams, its loss
state such as the SwAV queue); the online probe, equal on every rank, on any world size."""

from typing import List, Optional, Tuple

from vistrain.checkpoint import (
    find_latest_checkpoint,
    load_sharded_checkpoint,
    read_metadata,
    restore_rng,
    resume_iteration,
    set_aside,
)
from vistrain.checkpoint.identity import check_same_run
from vistrain.config.words import plural
from vistrain.distributed import comm
from vistrain.runtime.logger import logger


def resume(run_dir: str, run, cfg=None) -> Tuple[int, int]:
    """Load the most advanced complete checkpoint of ``run_dir`` (saved on any world size) into
    ``run`` (the trainer's: its models, optimizer, criterion, epoch layout and loss scaling).
    ``cfg``, when given: the run's config, refused in one line before anything is loaded when the
    folder trains other data, another method or model, or on another schedule
    (``vistrain.checkpoint.identity``).

    Returns (the iteration to continue from, the resumed checkpoint's own iteration); (0, 0) when
    there is none.
    """
    # rank 0 decides (and sets unreadable checkpoints aside) for everyone
    path = comm.all_gather_object(pick_checkpoint(run_dir) if comm.is_main_process() else None)[0]
    if path is None:
        return 0, 0
    if cfg is not None:  # every rank reads the same metadata: the same answer everywhere
        saved, world = read_metadata(path), comm.get_world_size()
        check_same_run(run_dir, saved, cfg, run.layout.num_samples, agreed=True, world_size=world)
    state = load_sharded_checkpoint(path, run.checkpointed_models(), run.optimizer)
    meta, extra = state["metadata"], state["extra"]
    iteration = resume_iteration(meta, run.layout, path)
    if state["same_world_size"]:  # per-rank state: rank r continues rank r's RNG streams and queue
        run.criterion.load_state_dict(extra["loss"])
        restore_rng(state["rng"])
    else:
        run.criterion.load_shared_state(extra["loss"])  # rank 0's: equal on every rank (DINO's centre)
        logger.info(
            f"{path} was saved by {plural(meta['world_size'], 'rank')}: per-rank loss state "
            "(such as a queue) and RNG streams start afresh"
        )
    if run.settings.scaling is not None:
        run.settings.scaling.load_state_dict(extra)
    if run.probe is not None:  # equal on every rank: rank 0's on any world size
        if "probe" in extra:
            run.probe.load_state_dict(extra["probe"])
        else:
            logger.info(f"{path} holds no online probe: the probe starts afresh")
    logger.info(f"resumed from {path} at iteration {iteration}")
    return iteration, meta["iteration"]


def pick_checkpoint(run_dir: str) -> Optional[str]:
    """Rank 0: the most advanced readable checkpoint; unreadable ones on the way are reported in
    one line each and renamed ``*.corrupt`` so that no save of this run can overwrite them."""
    unreadable: List[Tuple[str, str]] = []
    path = find_latest_checkpoint(run_dir, unreadable)
    for bad, reason in unreadable:
        kept = set_aside(bad)
        logger.warning(f"skipping unreadable checkpoint: {reason}; kept as {kept}")
    return path
