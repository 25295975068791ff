"""Keeping a job's processes and its run folder in order, whatever kills it.

* :func:`lock_run_folder`: one run per ``CHECKPOINT.DIR``. The launcher (or rank 0 of a joined
  job) holds an exclusive ``flock`` on ``<dir>/.vistrain.lock`` for the job's life; the kernel drops
  it when the process dies, whatever the signal, so there is no stale lock to clean up. A second
  run gets :class:`RunFolderBusyError` naming the holder (host, pid, since when); a folder that
  cannot be created or opened is a one-line ConfigError. Forked children close their copy of the
  lock's file, so the lock is the holder's alone.
* :func:`bind_to_launcher`: a spawned rank never outlives its launcher. On Linux the kernel sends
  it SIGKILL when the launcher dies (``prctl(PR_SET_PDEATHSIG)``); elsewhere, and as a second line
  of defence, a thread exits the rank once its parent pid changes (it was re-parented).
  :func:`die_with_parent` does the same for a rank's DataLoader workers.
* :func:`spawning_ignores_sigint`: ranks are started with SIGINT ignored, so Ctrl-C (SIGINT to
  the whole process group) reaches only the launcher, which stops the ranks itself: no
  KeyboardInterrupt tracebacks from every rank, no C++ "terminate called" from dying gloo threads.
"""

import contextlib
import ctypes
import datetime
import fcntl
import os
import signal
import socket
import sys
import threading
import time
from typing import Iterator

from vistrain.config.errors import ConfigError, InputError

LOCK_NAME = ".vistrain.lock"
PARENT_POLL_SECONDS = 1.0  # how often a rank checks that its launcher is still its parent
_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


class RunFolderBusyError(InputError):
    """Another live run holds the run folder; the message (one line) names it."""

    kind = "run folder busy"


@contextlib.contextmanager
def lock_run_folder(run_dir: str) -> Iterator[str]:
    """Hold the exclusive lock of ``run_dir`` (created if missing) for the ``with`` body.

    Yields the lock file's path. Raises RunFolderBusyError at once if another process holds it,
    ConfigError if the folder cannot be created or the lock file not opened (the config check
    probes this before; the file system may change in between).
    """
    path = os.path.join(run_dir, LOCK_NAME)
    try:
        os.makedirs(run_dir, exist_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as error:
        raise ConfigError(
            f"CHECKPOINT.DIR {run_dir} cannot be used ({error.strerror}); choose another CHECKPOINT.DIR"
        ) from None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 512, 0).decode(errors="replace").strip() or "unknown process"
            raise RunFolderBusyError(
                f"{run_dir} is in use by another run ({holder}); wait for it to end or choose "
                "another CHECKPOINT.DIR"
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, _holder_line().encode(), 0)
        _held_locks.add(fd)
        yield path
    finally:
        _held_locks.discard(fd)
        os.close(fd)  # releases the lock (so does the process' death)


# A flock belongs to the open file, which a forked child (a CPU rank, a DataLoader worker) shares:
# the lock would then last until the last child exited, not until the launcher did.
_held_locks: set = set()


def _drop_inherited_locks() -> None:
    for fd in _held_locks:  # this process' copies only: the parent keeps its lock
        os.close(fd)
    _held_locks.clear()


os.register_at_fork(after_in_child=_drop_inherited_locks)


def _holder_line() -> str:
    since = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")
    return f"host {socket.gethostname()}, pid {os.getpid()}, since {since}\n"


# --------------------------------------------------------------------------------------------
# ranks die with their launcher


def bind_to_launcher(launcher_pid: int) -> None:
    """Call first thing in a spawned rank: exit when process ``launcher_pid`` (our parent) dies."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the launcher's to handle
    die_with_parent(launcher_pid)
    threading.Thread(target=_exit_when_orphaned, args=(launcher_pid,), daemon=True).start()


def die_with_parent(parent_pid: int) -> None:
    """This process gets SIGKILL from the kernel when ``parent_pid`` (its parent) dies (Linux
    ``PR_SET_PDEATHSIG``; elsewhere nothing); it exits at once if the parent is already gone.
    Used by spawned ranks and by a rank's DataLoader workers: a rank that ends with a one-line
    error leaves at once (``os._exit``), and its workers must not keep loading batches after it."""
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent_pid:  # it died before prctl took effect
        os._exit(1)


def _exit_when_orphaned(launcher_pid: int) -> None:
    while os.getppid() == launcher_pid:
        time.sleep(PARENT_POLL_SECONDS)
    os._exit(1)  # no cleanup: peers are dying too, and a half-written save stays a .tmp folder


@contextlib.contextmanager
def spawning_ignores_sigint() -> Iterator[None]:
    """Processes started inside inherit SIGINT ignored (a fresh Python keeps an ignored SIGINT),
    so even a Ctrl-C during their start-up never reaches them."""
    if threading.current_thread() is not threading.main_thread():  # only it may set handlers
        yield
        return
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
