"""Training checkpoints: ``CHECKPOINT.DIR/checkpoint_<iteration>/``.

Layout of one checkpoint::

    model.pt             full (consolidated) model weights, written by rank 0
    optim_rank<r>.pt     rank r's optimizer state (differs per rank under sharding), grad scaler
                         and loss state (e.g. the SwAV queue, which is per rank)
    meta.json            epoch, iteration, world size, config; written LAST by rank 0

A checkpoint counts only once meta.json exists, and every file is written to a temporary name,
fsync'd and renamed, so a job killed at any moment leaves either a complete checkpoint or one that
is ignored. Resuming needs the same world size (the per-rank optimizer files).
"""

import json
import os
import re
import shutil
from typing import List, Optional

import torch

from vistrain.distributed import comm
from vistrain.engine.parallel import full_state_dict, load_full_state_dict

META = "meta.json"
_NAME = re.compile(r"^checkpoint_(\d+)$")


def save_checkpoint(ckpt_dir: str, iteration: int, epoch: int, model, optimizer, extra: dict,
                    meta: dict, keep_last: int) -> str:
    """Write ``checkpoint_<iteration>`` (collective: every rank calls it). Returns its path.

    ``extra`` is per-rank state saved next to the optimizer's (grad scaler, loss state dicts);
    ``meta`` is added to meta.json (e.g. the config). Afterwards only the ``keep_last`` newest
    complete checkpoints remain.
    """
    path = os.path.join(ckpt_dir, f"checkpoint_{iteration}")
    rank = comm.get_rank()
    model_state = full_state_dict(model)  # collective under sharding: on every rank
    if rank == 0:
        os.makedirs(path, exist_ok=True)
        _remove(os.path.join(path, META))  # re-saving an iteration: incomplete until the end
    comm.barrier()
    if rank == 0:
        _atomic_save(model_state, os.path.join(path, "model.pt"))
    _atomic_save({"optimizer": optimizer.state_dict(), **extra}, os.path.join(path, f"optim_rank{rank}.pt"))
    comm.barrier()  # every rank's files are on disk before meta.json makes the checkpoint count
    if rank == 0:
        info = {"iteration": iteration, "epoch": epoch, "world_size": comm.get_world_size(), **meta}
        _atomic_write_text(json.dumps(info, indent=1), os.path.join(path, META))
        _prune(ckpt_dir, keep_last)
    comm.barrier()
    return path


def find_latest_checkpoint(ckpt_dir: str) -> Optional[str]:
    """Path of the complete checkpoint with the highest iteration in ``ckpt_dir``, or None."""
    complete = [p for _, p in _listed(ckpt_dir) if os.path.exists(os.path.join(p, META))]
    return complete[-1] if complete else None


def read_meta(path: str) -> dict:
    with open(os.path.join(path, META)) as f:
        return json.load(f)


def load_checkpoint(path: str, model, optimizer) -> dict:
    """Load weights and this rank's optimizer state from ``path``; return this rank's extra state + meta.

    Raises ValueError when the checkpoint was written by a different number of ranks.
    """
    meta = read_meta(path)
    world = comm.get_world_size()
    if meta["world_size"] != world:
        raise ValueError(
            f"checkpoint {path} was written by {meta['world_size']} ranks but this run has {world}; "
            f"resuming on a different world size is not supported (use the same DISTRIBUTED sizes)"
        )
    model_state = torch.load(os.path.join(path, "model.pt"), map_location="cpu", weights_only=True)
    load_full_state_dict(model, model_state)
    rank_file = os.path.join(path, f"optim_rank{comm.get_rank()}.pt")
    state = torch.load(rank_file, map_location="cpu", weights_only=True)
    optimizer.load_state_dict(state.pop("optimizer"))
    state["meta"] = meta
    return state


# --------------------------------------------------------------------------------------------


def _listed(ckpt_dir: str) -> List:
    """(iteration, path) of every checkpoint_<n> folder, oldest first."""
    if not os.path.isdir(ckpt_dir):
        return []
    found = [(int(m.group(1)), os.path.join(ckpt_dir, n)) for n in os.listdir(ckpt_dir) if (m := _NAME.match(n))]
    return sorted(found)


def _prune(ckpt_dir: str, keep_last: int) -> None:
    """Keep the ``keep_last`` newest complete checkpoints; also drop incomplete ones older than them."""
    listed = _listed(ckpt_dir)
    complete = [it for it, p in listed if os.path.exists(os.path.join(p, META))]
    if keep_last <= 0 or len(complete) <= keep_last:
        return
    oldest_kept = complete[-keep_last]
    for iteration, path in listed:
        if iteration < oldest_kept:
            shutil.rmtree(path, ignore_errors=True)


def _atomic_save(obj, path: str) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(os.path.dirname(path))


def _atomic_write_text(text: str, path: str) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(os.path.dirname(path))


def _fsync_dir(path: str) -> None:
    # the rename itself is durable only once the directory entry is flushed
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _remove(path: str) -> None:
    if os.path.exists(path):
        os.remove(path)
