"""Files of a sharded checkpoint (format: vistrain.checkpoint): names, safe reading, crash-safe
writing (``.tmp`` folder, fsync, rename), discovery and pruning."""

import contextlib
import json
import os
import re
import shutil
import zipfile
from typing import List, Optional, Tuple

import torch

from vistrain.config.errors import InputError

FORMAT = "vistrain-sharded-checkpoint/1"
METADATA = "metadata.json"
TMP_SUFFIX = ".tmp"
_OLD_SUFFIX = ".old"  # a checkpoint being replaced by a re-save of the same iteration
_CORRUPT_SUFFIX = ".corrupt"  # an unreadable checkpoint a resuming run skipped (set_aside)
_NAME = re.compile(r"^checkpoint_(\d+)$")
_CORRUPT_NAME = re.compile(r"^checkpoint_\d+\.corrupt\d*$")
KEEP_CORRUPT = 2  # checkpoints set aside as unreadable that pruning keeps, the most recent ones


class CheckpointError(InputError):
    """A checkpoint that is incomplete, corrupt, unsafe, does not match the model, or could not be
    written (a full disk); one line naming the file."""

    kind = "checkpoint error"


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
    try:
        return _load(path, map_location="cpu", mmap=mmap)
    except CheckpointError as error:
        if mmap and "mmap can only be used" in str(error):
            return _load(path, map_location="cpu", mmap=False)
        raise


def load_structure(path: str):
    """What ``path`` holds, every tensor a meta tensor of its shape and dtype: no tensor data is
    read (torch notes where each storage's bytes start, see ``tensor_file.TensorFile``).
    CheckpointError as :func:`safe_load`."""
    return _load(path, map_location="meta")


def _load(path: str, **kwargs):
    if not os.path.isfile(path):
        raise CheckpointError(f"{path}: file not found (incomplete checkpoint?)")
    try:
        return torch.load(path, weights_only=True, **kwargs)
    except Exception as error:  # zip, pickle, EOF, weights_only refusals: all mean "bad file"
        raise CheckpointError(
            f"{path}: corrupt, truncated or unsafe checkpoint file ({_why(path, error)})"
        ) from None


def _why(path: str, error: Exception) -> str:
    """What was wrong with a file torch.load refused, in words (torch's own message for a file that
    is no checkpoint at all is "KeyError: 101", or advice to turn the safety check off)."""
    if not zipfile.is_zipfile(path):  # torch.save writes a zip archive; the end of a truncated one is missing
        return "not a whole zip archive as torch.save writes, nor a legacy file of plain tensors"
    if str(error).startswith("Weights only load failed"):
        return "it holds objects other than tensors and plain containers; loading never runs code"
    return f"{type(error).__name__}: {_first_line(error)}"


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


@contextlib.contextmanager
def atomic_file(path: str):
    """Yield a temporary name beside ``path`` to write; when the block ends without an error it
    is fsynced and renamed to ``path`` (which is then either absent or complete); else removed."""
    tmp = path + TMP_SUFFIX
    try:
        yield tmp
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
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
# discovery: checkpoints ranked by training progress, not by their iteration number
#
# Iteration numbers mean different progress at different world sizes (4 iterations per epoch on
# 2 ranks, 3 on 3 ranks), so "latest" is the checkpoint with the most samples seen
# (``samples_seen`` = epoch * num_samples + iteration_in_epoch * global_batch, metadata.json).


def list_checkpoints(run_dir: str) -> List[Tuple[int, str]]:
    """(iteration, path) of every ``checkpoint_<n>`` folder (complete or not), by iteration."""
    if not os.path.isdir(run_dir):
        return []
    found = [
        (int(m.group(1)), os.path.join(run_dir, name))
        for name in os.listdir(run_dir)
        if (m := _NAME.match(name))
    ]
    return sorted(found)


def progress_key(meta: dict) -> Tuple[int, int]:
    """Sort key of a checkpoint's progress: (samples seen, iteration). Checkpoints written without
    ``samples_seen`` (weights-only saves, other tools) rank below those with it, by iteration."""
    return (int(meta.get("samples_seen", -1)), int(meta["iteration"]))


def is_complete(path: str) -> bool:
    """metadata.json is present and parses, and every rank file it lists exists."""
    try:
        meta = read_metadata(path)
    except CheckpointError:
        return False
    return all(os.path.isfile(os.path.join(path, name)) for name in meta.get("rank_files", []))


def ranked_checkpoints(run_dir: str) -> Tuple[List[str], List[Tuple[str, str]]]:
    """(complete checkpoints, most advanced first; [(path, reason)] of unreadable ones).

    A folder without ``metadata.json`` is an interrupted save or not ours and is neither; one whose
    metadata.json does not parse, or lacks a rank file it lists, is unreadable.
    """
    ranked, unreadable = [], []
    for _, path in list_checkpoints(run_dir):
        if not os.path.exists(os.path.join(path, METADATA)):
            continue
        try:
            meta = read_metadata(path)
            missing = [n for n in meta.get("rank_files", []) if not os.path.isfile(os.path.join(path, n))]
            if missing:
                raise CheckpointError(f"{path}: rank file {missing[0]} is missing")
            ranked.append((progress_key(meta), path))
        except (CheckpointError, KeyError, TypeError, ValueError) as error:
            unreadable.append((path, _first_line(error)))
    return [path for _, path in sorted(ranked, reverse=True)], unreadable


def check_readable(path: str) -> None:
    """CheckpointError (one line) unless every rank file of ``path`` opens (memory-mapped: only
    the zip directory and the pickled structure are read, so this is cheap)."""
    meta = read_metadata(path)
    for name in meta.get("rank_files", []):
        safe_load(os.path.join(path, name))


def find_latest_checkpoint(run_dir: str, unreadable: Optional[List[Tuple[str, str]]] = None) -> Optional[str]:
    """Path of the most advanced complete, readable checkpoint in ``run_dir``, or None.

    Unreadable checkpoints (corrupt metadata.json or rank file) are skipped; ``unreadable``, when
    given, receives (path, one-line reason) for each of them, so the caller can report them.
    """
    ranked, bad = ranked_checkpoints(run_dir)
    found = None
    for path in ranked:
        try:
            check_readable(path)
        except CheckpointError as error:
            bad.append((path, _first_line(error)))
            continue
        found = path
        break
    if unreadable is not None:
        unreadable.extend(bad)
    return found


def set_aside(path: str) -> str:
    """Rename an unreadable checkpoint to ``<path>.corrupt`` (``.corrupt2``... if taken) so no
    later save reuses its name and overwrites it; returns the new path."""
    for n in range(1, 1000):
        target = f"{path}{_CORRUPT_SUFFIX}{n if n > 1 else ''}"
        if not os.path.exists(target):
            os.replace(path, target)
            fsync_dir(os.path.dirname(path))
            return target
    raise CheckpointError(f"{path}: cannot set it aside, {path}{_CORRUPT_SUFFIX}* all taken")


def prune(run_dir: str, keep_last: int) -> None:
    """Keep the ``keep_last`` most advanced complete checkpoints (all when <= 0); delete the other
    complete ones, leftovers of interrupted saves (``.tmp``), and the checkpoints set aside as
    unreadable (``.corrupt``) but the KEEP_CORRUPT most recently set aside (to look into).
    Unreadable checkpoints not yet set aside are left alone (their progress is unknown)."""
    ranked, _ = ranked_checkpoints(run_dir)
    if keep_last > 0:
        for path in ranked[keep_last:]:
            shutil.rmtree(path, ignore_errors=True)
    for name in os.listdir(run_dir):
        if name.endswith(TMP_SUFFIX) and _NAME.match(name[: -len(TMP_SUFFIX)]):
            shutil.rmtree(os.path.join(run_dir, name), ignore_errors=True)
    for path in set_aside_checkpoints(run_dir)[KEEP_CORRUPT:]:
        shutil.rmtree(path, ignore_errors=True)


def set_aside_checkpoints(run_dir: str) -> List[str]:
    """The ``checkpoint_<n>.corrupt[k]`` folders of ``run_dir``, most recently set aside first
    (the rename set their status-change time)."""
    found = [os.path.join(run_dir, name) for name in os.listdir(run_dir) if _CORRUPT_NAME.match(name)]
    return sorted(found, key=lambda path: (os.stat(path).st_ctime_ns, path), reverse=True)
