"""Files of a sharded checkpoint (format: vistrain.checkpoint): names, safe reading, crash-safe
writing (``.tmp`` folder, fsync, rename), discovery and pruning."""

import json
import os
import re
import shutil
from typing import List, Optional, Tuple

import torch

FORMAT = "vistrain-sharded-checkpoint/1"
METADATA = "metadata.json"
TMP_SUFFIX = ".tmp"
_OLD_SUFFIX = ".old"  # a checkpoint being replaced by a re-save of the same iteration
_NAME = re.compile(r"^checkpoint_(\d+)$")


class CheckpointError(ValueError):
    """A checkpoint that is incomplete, corrupt, unsafe, or does not match the model."""


def checkpoint_name(iteration: int) -> str:
    return f"checkpoint_{iteration}"


def rank_file(path: str, rank: int) -> str:
    """``path/rank<rank>.pt``: what rank ``rank`` of the saving job wrote."""
    return os.path.join(path, f"rank{rank}.pt")


def safe_load(path: str, mmap: bool = True):
    """``torch.load(path, weights_only=True)`` on CPU; memory-mapped so only touched bytes are read.

    Raises CheckpointError (one line, naming ``path``) for a missing, truncated, corrupt or
    code-carrying file. Files saved in torch's legacy (non-zip) format are read without mmap.
    """
    if not os.path.isfile(path):
        raise CheckpointError(f"{path}: file not found (incomplete checkpoint?)")
    try:
        return torch.load(path, map_location="cpu", mmap=mmap, weights_only=True)
    except Exception as error:  # zip, pickle, EOF, weights_only refusals: all mean "bad file"
        if mmap and "mmap can only be used" in str(error):
            return safe_load(path, mmap=False)
        raise CheckpointError(
            f"{path}: corrupt, truncated or unsafe checkpoint file "
            f"({type(error).__name__}: {_first_line(error)})"
        ) from None


def _first_line(error: Exception) -> str:
    text = str(error).strip().splitlines()
    return text[0][:200] if text else "no details"


def read_metadata(path: str) -> dict:
    """The parsed ``metadata.json`` of checkpoint folder ``path`` (CheckpointError if absent or bad)."""
    file = os.path.join(path, METADATA)
    if not os.path.isfile(file):
        raise CheckpointError(f"{path}: not a complete vistrain checkpoint (no {METADATA})")
    try:
        with open(file) as f:
            meta = json.load(f)
    except (OSError, ValueError) as error:
        raise CheckpointError(f"{file}: unreadable metadata ({_first_line(error)})") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        found = meta.get("format") if isinstance(meta, dict) else type(meta).__name__
        raise CheckpointError(f"{file}: format {found!r} is not {FORMAT!r}")
    return meta


# --------------------------------------------------------------------------------------------
# crash-safe writing


def save_file(obj, path: str) -> None:
    """``torch.save`` to ``path`` and fsync it (the folder rename makes it visible)."""
    with open(path, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())


def write_json(obj, path: str) -> None:
    """Write JSON to a temporary name, fsync, rename: ``path`` is either absent or complete."""
    tmp = path + TMP_SUFFIX
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(os.path.dirname(path))


def save_atomic(obj, path: str) -> None:
    """``torch.save`` to a temporary name, fsync, rename (single files: conversions)."""
    tmp = path + TMP_SUFFIX
    save_file(obj, tmp)
    os.replace(tmp, path)
    fsync_dir(os.path.dirname(os.path.abspath(path)))


def fsync_dir(path: str) -> None:
    # a rename is durable only once the directory entry itself is flushed
    fd = os.open(path or ".", os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def publish(tmp: str, final: str) -> None:
    """Atomically give the finished folder ``tmp`` its final name (replacing an older ``final``)."""
    old = final + _OLD_SUFFIX
    if os.path.exists(final):  # re-saving an iteration: move the old one aside, never half-delete it
        shutil.rmtree(old, ignore_errors=True)
        os.replace(final, old)
    os.replace(tmp, final)
    fsync_dir(os.path.dirname(final))
    shutil.rmtree(old, ignore_errors=True)


# --------------------------------------------------------------------------------------------
# discovery


def list_checkpoints(run_dir: str) -> List[Tuple[int, str]]:
    """(iteration, path) of every ``checkpoint_<n>`` folder (complete or not), oldest first."""
    if not os.path.isdir(run_dir):
        return []
    found = [
        (int(m.group(1)), os.path.join(run_dir, name))
        for name in os.listdir(run_dir)
        if (m := _NAME.match(name))
    ]
    return sorted(found)


def is_complete(path: str) -> bool:
    """metadata.json is present and parses, and every rank file it lists exists."""
    try:
        meta = read_metadata(path)
    except CheckpointError:
        return False
    return all(os.path.isfile(os.path.join(path, name)) for name in meta.get("rank_files", []))


def find_latest_checkpoint(run_dir: str) -> Optional[str]:
    """Path of the complete checkpoint with the highest iteration in ``run_dir``, or None."""
    for _, path in reversed(list_checkpoints(run_dir)):
        if is_complete(path):
            return path
    return None


def prune(run_dir: str, keep_last: int) -> None:
    """Keep the ``keep_last`` newest complete checkpoints (all when <= 0); drop older folders and
    leftovers of interrupted saves (``.tmp``)."""
    listed = list_checkpoints(run_dir)
    complete = [it for it, path in listed if is_complete(path)]
    if keep_last > 0 and len(complete) > keep_last:
        oldest_kept = complete[-keep_last]
        for iteration, path in listed:
            if iteration < oldest_kept:
                shutil.rmtree(path, ignore_errors=True)
    for name in os.listdir(run_dir):
        if name.endswith(TMP_SUFFIX) and _NAME.match(name[: -len(TMP_SUFFIX)]):
            shutil.rmtree(os.path.join(run_dir, name), ignore_errors=True)
