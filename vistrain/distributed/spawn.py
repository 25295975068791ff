"""Ranks the launcher spawns on this machine, and watching them until the job ends.

:func:`spawn_and_watch` starts ``NUM_PROC_PER_NODE`` processes and waits. As soon as one exits
non-zero (an exception, a SIGKILL, the OOM killer) the others get a few seconds to stop on their
own, then SIGKILL; the launcher raises what ended the job (:func:`_failure`): the one-line error a
rank reported (its peers failing after it are consequences), a stop signal (SIGTERM / SIGUSR1,
forwarded to the ranks, which stop at an iteration boundary and save), or :class:`RankFailedError`
with the failing rank's traceback. Ctrl-C reaches only the launcher, which kills the ranks at once.
"""

import json
import multiprocessing.connection
import os
import shutil
import signal
import sys
import tempfile
import time
import traceback
from typing import Dict, List, Optional, Tuple

import torch
import torch.distributed
import torch.multiprocessing as mp
from fvcore.common.config import CfgNode

from vistrain.config.errors import EXIT_STOPPED, OneLineExit, StopRequested, rebuilt
from vistrain.distributed import supervise
from vistrain.distributed.rank import LaunchPlan, start_rank
from vistrain.distributed.stop_signals import STOP_SIGNALS, Forwarder, signal_name


def _thread_count() -> int:
    """Threads of this process (Linux); 0 where /proc does not say."""
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        return 0


# What importing torch leaves running here (torch.multiprocessing is imported above), before
# any computation could start OpenMP's pool: see _start_method.
_THREADS_AT_IMPORT = _thread_count()

STOP_GRACE_SECONDS = 5.0  # after a failure, time the other ranks get to exit on their own, then SIGKILL
# A spawned rank's DataLoader queues register their semaphores with the launcher's multiprocessing
# resource tracker. A rank that ends the job (a one-line error, a stop signal) leaves at once
# (os._exit) without unregistering them: the tracker unlinks them when the job ends, and would add a
# two-line "leaked semaphore objects" UserWarning after the job's one line. Python starts the
# tracker (and the ranks) with the launcher's -W options, so this filter reaches it.
_QUIET_TRACKER = "ignore::UserWarning:multiprocessing.resource_tracker"


class RankFailedError(RuntimeError):
    """A rank of a spawned job failed; the message holds its traceback (or exit code / signal)."""


def _run_rank(local_rank: int, main_fn, cfg: CfgNode, plan: LaunchPlan, error_dir: str) -> None:
    """Body of every spawned rank: ``start_rank``; on failure its one-line error (kind, line, exit
    code) or its traceback written to ``error_dir`` for the launcher."""
    try:
        start_rank(local_rank, main_fn, cfg, plan)
    except OneLineExit as error:
        report = {"kind": error.kind, "message": str(error), "exit_code": error.exit_code}
        _write_report(error_dir, local_rank, ONE_LINE, json.dumps(report))
        raise
    except BaseException:
        _write_report(error_dir, local_rank, TRACEBACK, traceback.format_exc())
        raise


def _run_spawned_rank(local_rank: int, launcher_pid: int, main_fn, cfg, plan, error_dir: str) -> None:
    for signum in STOP_SIGNALS:  # a forked rank inherits the launcher's forwarding handlers
        signal.signal(signum, signal.SIG_DFL)
    supervise.bind_to_launcher(launcher_pid)  # never outlive the launcher, leave Ctrl-C to it
    try:
        _run_rank(local_rank, main_fn, cfg, plan, error_dir)
    except BaseException:
        # Reported in error_dir; leave at once: tearing down an interpreter whose process group's
        # peers are gone can abort with C++ "terminate called" noise on the launcher's stderr.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)


def spawn_and_watch(main_fn, cfg: CfgNode, plan: LaunchPlan, may_fork: bool = False) -> None:
    error_dir = tempfile.mkdtemp(prefix="vistrain-ranks-")
    if _QUIET_TRACKER not in sys.warnoptions:
        sys.warnoptions.append(_QUIET_TRACKER)
    try:
        with Forwarder(cfg.CHECKPOINT.STOP_GRACE_SECONDS) as stop:
            with supervise.spawning_ignores_sigint():
                context = mp.start_processes(
                    _run_spawned_rank,
                    args=(os.getpid(), main_fn, cfg, plan, error_dir),
                    nprocs=plan.local_ranks,
                    join=False,
                    start_method=_start_method(plan, may_fork),
                )
            processes = context.processes
            stop.watch([p.pid for p in processes])
            _watch(processes, stop, error_dir, plan.first_rank)
    finally:
        shutil.rmtree(error_dir, ignore_errors=True)


def _start_method(plan: LaunchPlan, may_fork: bool) -> str:
    """``fork`` for CPU ranks of a process that has computed nothing, else ``spawn``.

    A forked rank starts at once with torch, torchvision and vistrain imported (a spawned one
    spends ~6 s of CPU importing them again). Forking is safe only from a process that has started
    no threads since it imported torch: no OpenMP pool (no parallel kernel ran), no gloo or CUDA.
    ``may_fork``: the caller is such a process (the command line's launcher: it plans, it does not
    compute); the thread count checks it still is. Anyone else (a notebook, a test) gets ``spawn``,
    as do CUDA ranks.
    """
    quiet = _THREADS_AT_IMPORT > 0 and _thread_count() == _THREADS_AT_IMPORT
    if may_fork and quiet and plan.device == "cpu" and sys.platform.startswith("linux"):
        if not torch.cuda.is_initialized() and not torch.distributed.is_initialized():
            return "fork"
    return "spawn"


def _watch(processes, stop: Forwarder, error_dir: str, first_rank: int) -> None:
    """Wait for the ranks; stop them all once one fails; raise what ended the job (see _failure)."""
    try:
        failed = _wait_for_failure(processes, stop)
    except KeyboardInterrupt:  # Ctrl-C: the ranks ignore SIGINT; stop them now, no grace
        _terminate(processes)
        raise
    except BaseException:
        _stop(processes)
        raise
    if failed or stop.signum is not None:
        # the others stop on their own (a failure ends their collectives; a stop signal their
        # loop) within the grace, else they are killed
        grace = STOP_GRACE_SECONDS if stop.deadline is None else max(0.0, stop.deadline - time.monotonic())
        _stop(processes, grace)
    if failed or any(p.exitcode != 0 for p in processes):
        raise _failure(failed, processes, error_dir, first_rank, stop.signum)


def _wait_for_failure(processes, stop: Forwarder) -> List[int]:
    """Block until every process exited 0 (returns []) or some exited non-zero (their indices), or
    the ranks outlived the deadline of a stop signal (returns [])."""
    while True:
        running = [p.sentinel for p in processes if p.exitcode is None]
        failed = [i for i, p in enumerate(processes) if p.exitcode not in (None, 0)]
        if failed or not running:
            return failed
        if stop.deadline is not None and time.monotonic() >= stop.deadline:
            return []
        wait = 5.0 if stop.deadline is None else min(5.0, max(0.1, stop.deadline - time.monotonic()))
        multiprocessing.connection.wait(running, timeout=wait)


def _stop(processes, grace: float = STOP_GRACE_SECONDS, escalation=(None, "kill")) -> None:
    """Let the other ranks exit on their own for ``grace`` s, then SIGKILL them (SIGTERM would ask
    them to stop at their next iteration boundary: a rank whose peer died never reaches it)."""
    for escalate in escalation:
        for p in processes:
            if escalate and p.is_alive():
                getattr(p, escalate)()
        deadline = time.monotonic() + grace
        for p in processes:
            p.join(max(0.0, deadline - time.monotonic()))
        if not any(p.is_alive() for p in processes):
            return


def _terminate(processes, grace: float = STOP_GRACE_SECONDS) -> None:
    """SIGKILL every rank; return once all are gone."""
    _stop(processes, grace, escalation=("kill",))


ONE_LINE, TRACEBACK = "one_line.json", "traceback.txt"  # what a failing rank leaves in error_dir


def _report_path(error_dir: str, local_rank: int, what: str) -> str:
    return os.path.join(error_dir, f"rank{local_rank}.{what}")


def _write_report(error_dir: str, local_rank: int, what: str, text: str) -> None:
    """A failing rank's report (``what``: ONE_LINE or TRACEBACK), written then renamed."""
    path = _report_path(error_dir, local_rank, what)
    with open(f"{path}.tmp", "w") as f:
        f.write(text)
    os.replace(f"{path}.tmp", path)


def _read_reports(error_dir: str, ranks, what: str) -> Dict[int, Tuple[float, str]]:
    """local rank -> (when written, text) of the reports ``what`` that ``ranks`` left."""
    reports = {}
    for i in ranks:
        path = _report_path(error_dir, i, what)
        if os.path.exists(path):
            with open(path) as f:
                reports[i] = (os.path.getmtime(path), f.read())
    return reports


def _failure(
    failed: List[int], processes, error_dir: str, first_rank: int, signum: Optional[int]
) -> Exception:
    """What to raise once every rank is stopped (``failed``: the ranks seen failing first): the
    first one-line error any rank reported (its peers failing after it are consequences, whenever
    the launcher noticed them); else, when a stop signal reached the launcher or a rank,
    StopRequested; else a RankFailedError. A rank that abandoned its step (exit 143, or killed at
    the end of the grace) outranks a peer's "every rank stopped": that peer only saw it leave."""
    reports = [
        (when, json.loads(text))
        for when, text in _read_reports(error_dir, range(len(processes)), ONE_LINE).values()
    ]
    only_stops = all(report["kind"] == "stopped" for _, report in reports)
    if reports and not (only_stops and _abandoned(processes)):
        first = min(reports, key=lambda item: item[0])[1]
        return rebuilt(first["kind"], first["message"], first["exit_code"])
    stopped = _stopped_by_signal(processes, signum)
    if stopped is not None:
        return StopRequested(stopped)
    failed = failed or [i for i, p in enumerate(processes) if p.exitcode not in (None, 0)]
    return RankFailedError(_failure_report(failed, processes, error_dir, first_rank))


def _stopped_by_signal(processes, signum: Optional[int]) -> Optional[str]:
    """Why the ranks ended, when a stop signal ended them without a rank saying so: it killed them
    before they handled it, their grace ran out (exit 143), or they outlived the launcher's wait."""
    codes = [p.exitcode for p in processes]
    killed = [-code for code in codes if code is not None and -code in STOP_SIGNALS]
    if signum is None and not killed and EXIT_STOPPED not in codes:
        return None
    name = signal_name(signum or (killed[0] if killed else signal.SIGTERM))
    if _abandoned(processes):
        return f"{name}: the step in progress did not end within the grace and was abandoned"
    return f"{name}: every rank stopped"


def _abandoned(processes) -> bool:
    """A rank ended by its own grace timer (exit 143) or killed at the end of the launcher's."""
    return any(p.exitcode in (EXIT_STOPPED, -signal.SIGKILL) for p in processes)


def _failure_report(failed: List[int], processes, error_dir: str, first_rank: int) -> str:
    """Describe the rank that failed first: its traceback if it raised, its signal if it was killed."""
    tracebacks = _read_reports(error_dir, failed, TRACEBACK)
    # A rank without a traceback died from a signal or os._exit; its peers then fail in
    # collectives, so it is the likelier cause. Among tracebacks, the earliest written wins.
    silent = [i for i in failed if i not in tracebacks]
    culprit = silent[0] if silent else min(tracebacks, key=lambda i: tracebacks[i][0])
    others = sorted(first_rank + i for i in failed if i != culprit)
    tail = f" (also failed: ranks {others})" if others else ""
    if culprit in tracebacks:
        return f"rank {first_rank + culprit} failed{tail}:\n{tracebacks[culprit][1].rstrip()}"
    return f"rank {first_rank + culprit} {_describe_exit(processes[culprit].exitcode)}{tail}"


def _describe_exit(code: int) -> str:
    if code < 0:
        try:
            return f"was killed by signal {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code} without a traceback"
