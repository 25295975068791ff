"""Bounded waits on the engine's collectives: a missing peer is an error, not a 30-minute hang.

Every asynchronous collective the engine issues (gathers, gradient reductions, buffer broadcasts,
the first step's order check) is waited on through ``wait_within``. When ranks run different
units, one of them waits for a collective its peers never issue; the wait then fails after
``timeout`` with a message saying what was waited for and the likely cause.
"""

import datetime

import torch

DEFAULT_COLLECTIVE_TIMEOUT = datetime.timedelta(minutes=5)


class CollectiveTimeout(RuntimeError):
    """A collective of the sharded engine did not complete within its timeout on this rank."""


class CollectiveError(RuntimeError):
    """A collective of the sharded engine failed on this rank for another reason (a peer that
    died or closed its connection, a transport error)."""


def as_timedelta(timeout) -> datetime.timedelta:
    """Seconds (int/float) or a timedelta; must be positive."""
    if not isinstance(timeout, datetime.timedelta):
        timeout = datetime.timedelta(seconds=float(timeout))
    if timeout.total_seconds() <= 0:
        raise ValueError(f"collective_timeout must be positive, got {timeout}")
    return timeout


def wait_within(work, timeout: datetime.timedelta, what, device: torch.device) -> None:
    """``work.wait()`` that raises ``CollectiveTimeout`` naming ``what`` (a string, or a function
    giving one, called only on failure) after ``timeout``, and ``CollectiveError`` naming it when
    the collective fails otherwise.

    On CUDA a wait with a timeout would block the CPU until the collective ends (NCCL polls),
    losing the overlap of communication and compute; there the wait stays stream-ordered and
    torch's NCCL watchdog bounds a hang by the process group's own timeout (10 minutes unless
    ``init_process_group(timeout=...)`` says otherwise).
    """
    try:
        if device.type == "cpu":
            work.wait(timeout=timeout)
        else:
            work.wait()
    except RuntimeError as error:
        described = what() if callable(what) else what
        if not is_timeout(error):
            raise CollectiveError(
                f"FullyShardedDataParallel: {described} failed on this rank: {error}"
            ) from error
        raise CollectiveTimeout(
            f"FullyShardedDataParallel: {described} did not complete within {timeout.total_seconds():g} s "
            f"on this rank ({error}). Ranks probably ran different units: a branch taken on some "
            "ranks only cannot be sharded; an output unused on some ranks needs "
            "find_unused_parameters=True"
        ) from error


def is_timeout(error: RuntimeError) -> bool:
    """Whether a failed wait timed out (gloo: "Operation timed out!", "Timed out waiting ...")
    rather than failed (a peer's connection reset or closed)."""
    return "timed out" in str(error).lower()
