"""SIGTERM and SIGUSR1: a job asked to end stops at an iteration boundary and saves, within a grace.

Schedulers end a job with SIGTERM and, a grace period later, SIGKILL: SLURM (``scancel``,
preemption, the time limit; ``KillWait``, 30 s by default), Kubernetes (30 s), torchrun's agent
(30 s) when it is itself stopped. SLURM's ``--signal=USR1@90`` warns with SIGUSR1 90 s before the
time limit. Some send the signal to the launcher only, some to every process of the job at once,
some to one rank (a lost node). Any of these ends the whole job the same way:

* In every rank, :class:`StopSignals` (installed by the launcher around the job, restored after)
  answers both signals. Until a training loop calls :meth:`StopSignals.defer`, a stop signal raises
  :class:`~vistrain.config.errors.StopRequested` in the main thread at once: there is nothing newer
  than the last checkpoint to save. Once deferred, the signal is only recorded; the loop asks at
  each iteration boundary whether any rank received one (one tiny collective, so every rank stops
  at the same boundary), saves a checkpoint there and raises StopRequested itself.
* Either way a timer ends the process ``grace_seconds`` after the signal if it is still running
  (exit 143): a step or a save that cannot finish in time is abandoned. Saves are written under a
  temporary name and renamed once complete, so the previous checkpoint stands.
* The launcher that spawned the ranks forwards a signal it receives to them (:class:`Forwarder`)
  and waits for them a little longer than their own grace before it kills what is left.

A rank's exit is reported once per job: by the launcher that spawned it, else (torchrun, srun,
one in-process rank) by global rank 0 (``announce``).
"""

import contextlib
import os
import signal
import sys
import threading
import time
from typing import Callable, List, Optional

from vistrain.config.errors import EXIT_STOPPED, StopRequested

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)
LAUNCHER_MARGIN_SECONDS = 10.0  # the spawning launcher waits this much beyond the ranks' grace


def install(handler) -> dict:
    """``handler`` for every stop signal; the previous handlers, for :func:`restore`. Only the
    main thread may set handlers: elsewhere nothing is installed."""
    if threading.current_thread() is not threading.main_thread():
        return {}
    return {sig: signal.signal(sig, handler) for sig in STOP_SIGNALS}


def restore(previous: dict) -> None:
    for sig, handler in previous.items():
        signal.signal(sig, handler)


def signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


class StopSignals:
    """This process' answer to SIGTERM / SIGUSR1 while a job runs in it (a context manager).

    ``announce(detail)``: prints the job's one line when the timer ends the process; None where
    somebody else reports (a spawned rank: its launcher; a rank other than global rank 0).
    Installed only from the main thread (Python delivers signals there); elsewhere it does nothing.
    """

    def __init__(self, grace_seconds: float, announce: Optional[Callable[[str], None]] = None):
        self.grace_seconds = grace_seconds
        self._announce = announce
        self._deferred = False
        self._signum: Optional[int] = None  # the first stop signal received
        self._raised = False
        self._timer: Optional[threading.Timer] = None
        self._previous: dict = {}

    # ---- installation
    def __enter__(self) -> "StopSignals":
        self._previous = install(self._on_signal)
        return self

    def __exit__(self, *exc) -> None:
        restore(self._previous)
        if self._timer is not None:
            self._timer.cancel()

    @staticmethod
    def installed() -> Optional["StopSignals"]:
        """The StopSignals handling SIGTERM in this process now (the launcher's), or None."""
        handler = signal.getsignal(signal.SIGTERM)
        owner = getattr(handler, "__self__", None)
        return owner if isinstance(owner, StopSignals) else None

    # ---- what the training loop uses
    def defer(self) -> None:
        """From now on a stop signal is only recorded: the caller stops at its next boundary."""
        self._deferred = True

    @property
    def received(self) -> int:
        """The stop signal this process received (its number), 0 when none."""
        return self._signum or 0

    # ---- the handler and its timer
    def _on_signal(self, signum: int, frame) -> None:
        if self._signum is None:
            self._signum = signum
            self._timer = threading.Timer(self.grace_seconds, self._abandon)
            self._timer.daemon = True
            self._timer.start()
        if not self._deferred and not self._raised:
            self._raised = True  # a second signal (launcher and scheduler both send one) changes nothing
            raise StopRequested(f"{signal_name(signum)}: every rank stopped")

    def _abandon(self) -> None:
        """Still running ``grace_seconds`` after the signal: end the process now (no cleanup: a
        half-written save stays a ``.tmp`` folder that the next save removes)."""
        if self._announce is not None:
            self._announce(
                f"{signal_name(self.received)}: the step in progress did not end within "
                f"{self.grace_seconds:g} s (CHECKPOINT.STOP_GRACE_SECONDS) and was abandoned"
            )
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(EXIT_STOPPED)


class Forwarder:
    """The spawning launcher's answer to SIGTERM / SIGUSR1 (a context manager): pass the signal on
    to its ranks (which stop and save themselves) and give them until :attr:`deadline`."""

    def __init__(self, grace_seconds: float):
        self.wait_seconds = grace_seconds + LAUNCHER_MARGIN_SECONDS
        self.signum: Optional[int] = None
        self.deadline: Optional[float] = None  # time.monotonic() by which the ranks must be gone
        self._pids: List[int] = []
        self._previous: dict = {}

    def __enter__(self) -> "Forwarder":
        self._previous = install(self._on_signal)
        return self

    def __exit__(self, *exc) -> None:
        restore(self._previous)

    def watch(self, pids: List[int]) -> None:
        """The ranks to forward to (a signal that came while they started is passed on now)."""
        self._pids = list(pids)
        if self.signum is not None:
            self._forward(self.signum)

    def _on_signal(self, signum: int, frame) -> None:
        if self.signum is None:
            self.signum = signum
            self.deadline = time.monotonic() + self.wait_seconds
        self._forward(signum)

    def _forward(self, signum: int) -> None:
        for pid in self._pids:
            with contextlib.suppress(ProcessLookupError):  # already gone
                os.kill(pid, signum)
