"""Start the ranks of a run: join torchrun / SLURM (see ``join.py``), or spawn local processes and watch them.

``launch(main_fn, cfg)`` always ends with ``main_fn(cfg)`` running on every rank inside an
initialised process group (also for a single process), so the engine never special-cases
"not distributed". When the launcher spawns the ranks itself it watches them: as soon as one rank
exits non-zero (an exception, a SIGKILL, the OOM killer) the others are stopped and
:class:`RankFailedError` carries the failing rank's traceback; a rank that found the user's input
wrong (:class:`~vistrain.config.InputError`, one line) has it raised again in the launcher instead.
A dead rank therefore never leaves its peers waiting in a collective until the timeout.
"""

import contextlib
import dataclasses
import datetime
import json
import multiprocessing.connection
import os
import shutil
import signal
import socket
import sys
import tempfile
import time
import traceback
from typing import Callable, Dict, List, Mapping, Optional, Tuple

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from fvcore.common.config import CfgNode

from vistrain.config.checks import DEVICES, DIST_BACKENDS, INIT_METHODS, check_world_size
from vistrain.config.errors import ConfigError, InputError
from vistrain.distributed import supervise
from vistrain.distributed.join import (  # noqa: F401  first_slurm_host: public here too
    attempt_store,
    first_slurm_host,
    joined_job,
)

STOP_GRACE_SECONDS = 5.0  # after a failure, time the other ranks get to exit on their own, then SIGTERM


class RankFailedError(RuntimeError):
    """A rank of a spawned job failed; the message holds its traceback (or exit code / signal)."""


@dataclasses.dataclass(frozen=True)
class LaunchPlan:
    """How this machine's ranks join the job. ``spawn`` False: this process is one rank already."""

    world_size: int
    first_rank: int  # global rank of the first process run here (spawn: NODE_ID * per-node ranks)
    local_ranks: int  # processes this launcher runs (1 when joining)
    local_rank: int  # node-local rank of that first process (joining: LOCAL_RANK / SLURM_LOCALID)
    init_method: str  # tcp://host:port | env:// | file://path
    backend: str  # nccl | gloo
    device: str  # cuda | cpu
    timeout_seconds: int
    spawn: bool
    ranks_per_node: int = 1  # processes sharing this machine (they split its CPU threads)
    device_index: int = 0  # CUDA device of that first process (0 when a task sees only its own GPU)
    notes: Tuple[str, ...] = ()  # DISTRIBUTED keys a joined job overrides, said once by rank 0
    elastic_attempt: Optional[int] = None  # torchrun: TORCHELASTIC_RESTART_COUNT of this worker group


# --------------------------------------------------------------------------------------------
# public API


def launch(main_fn: Callable[[CfgNode], object], cfg: CfgNode) -> None:
    """Run ``main_fn(cfg)`` on every rank of the job described by ``cfg.DISTRIBUTED``.

    ``main_fn`` must be a module-level function (it is pickled for spawned processes).
    Raises ConfigError (before anything starts) for impossible settings, RunFolderBusyError when
    another run holds ``CHECKPOINT.DIR``, the InputError of a rank that found the input wrong
    (every rank stopped), and RankFailedError when a spawned rank fails otherwise.
    """
    plan = plan_launch(cfg.DISTRIBUTED, cfg.MACHINE, os.environ)
    check_world_size(cfg, plan.world_size)  # hybrid sharding's groups must tile the job
    _print_notes(plan)
    with _run_folder_lock(cfg, plan):
        if not plan.spawn:
            _start_rank(0, main_fn, cfg, plan)
        elif plan.local_ranks == 1:
            _run_in_this_process(main_fn, cfg, plan)
        else:
            _spawn_and_watch(main_fn, cfg, plan)


def planned_world_size(dist_cfg: CfgNode, environ: Mapping[str, str]) -> int:
    """Ranks of the job :func:`plan_launch` would start or join (without taking a port)."""
    job = joined_job(dist_cfg, environ)
    return job.world_size if job is not None else dist_cfg.NUM_NODES * dist_cfg.NUM_PROC_PER_NODE


def resolve_device(machine_cfg: CfgNode) -> str:
    """MACHINE.DEVICE -> "cuda" | "cpu" ("auto": cuda when available)."""
    choice = machine_cfg.DEVICE
    if choice not in DEVICES:
        raise ConfigError(f"MACHINE.DEVICE must be auto, cpu or cuda, got {choice!r}")
    if choice == "cuda" and not torch.cuda.is_available():
        raise ConfigError("MACHINE.DEVICE=cuda but no CUDA device is available")
    if choice == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return choice


def plan_launch(dist_cfg: CfgNode, machine_cfg: CfgNode, environ: Mapping[str, str]) -> LaunchPlan:
    """Decide ranks, rendezvous and backend from the config and the environment (pure but for CUDA queries)."""
    device = resolve_device(machine_cfg)
    backend = _backend(dist_cfg.BACKEND, device)
    if dist_cfg.TIMEOUT_SECONDS <= 0:
        raise ConfigError(f"DISTRIBUTED.TIMEOUT_SECONDS must be > 0, got {dist_cfg.TIMEOUT_SECONDS}")
    common = dict(backend=backend, device=device, timeout_seconds=dist_cfg.TIMEOUT_SECONDS)
    job = joined_job(dist_cfg, environ)
    if job is not None:
        return LaunchPlan(
            world_size=job.world_size,
            first_rank=job.rank,
            local_ranks=1,
            local_rank=job.local_rank,
            init_method=job.init_method,
            spawn=False,
            ranks_per_node=job.ranks_per_node,
            device_index=_joined_device_index(device, job.local_rank),
            notes=job.notes,
            elastic_attempt=job.elastic_attempt,
            **common,
        )
    per_node, nodes, node_id = _check_sizes(dist_cfg)
    _check_local_devices(device, per_node)
    init_method = _init_method(dist_cfg, environ, nodes)
    return LaunchPlan(
        nodes * per_node,
        node_id * per_node,
        per_node,
        0,
        init_method,
        spawn=True,
        ranks_per_node=per_node,
        **common,
    )


# --------------------------------------------------------------------------------------------
# planning


def _backend(choice: str, device: str) -> str:
    if choice == "auto":
        return "nccl" if device == "cuda" else "gloo"
    if choice not in DIST_BACKENDS:
        raise ConfigError(f"DISTRIBUTED.BACKEND must be auto, nccl or gloo, got {choice!r}")
    if choice == "nccl" and device != "cuda":
        raise ConfigError("DISTRIBUTED.BACKEND=nccl needs CUDA; use gloo (or auto) on CPU")
    return choice


def _check_sizes(dist_cfg: CfgNode):
    per_node, nodes, node_id = dist_cfg.NUM_PROC_PER_NODE, dist_cfg.NUM_NODES, dist_cfg.NODE_ID
    if per_node < 1 or nodes < 1:
        raise ConfigError(f"DISTRIBUTED.NUM_PROC_PER_NODE ({per_node}) and NUM_NODES ({nodes}) must be >= 1")
    if not 0 <= node_id < nodes:
        raise ConfigError(f"DISTRIBUTED.NODE_ID must be in [0, {nodes}), got {node_id}")
    return per_node, nodes, node_id


def _check_local_devices(device: str, needed: int) -> None:
    if device == "cuda" and needed > torch.cuda.device_count():
        raise ConfigError(
            f"{needed} ranks on this machine need {needed} GPUs; {torch.cuda.device_count()} visible"
        )


def _joined_device_index(device: str, local_rank: int) -> int:
    """GPU of a joined rank: its local rank, or 0 where SLURM/the user binds one GPU per task."""
    if device != "cuda":
        return 0
    visible = torch.cuda.device_count()
    if visible == 1:
        return 0
    _check_local_devices(device, local_rank + 1)
    return local_rank


def _print_notes(plan: LaunchPlan) -> None:
    if plan.first_rank == 0:  # once per job, before anything starts
        for note in plan.notes:
            print(f"vistrain: {note}", file=sys.stderr, flush=True)


def _init_method(dist_cfg: CfgNode, environ: Mapping[str, str], nodes: int) -> str:
    method, run_id = dist_cfg.INIT_METHOD, dist_cfg.RUN_ID
    if method not in INIT_METHODS:
        raise ConfigError(f"DISTRIBUTED.INIT_METHOD must be tcp, env or file, got {method!r}")
    if run_id == "auto" and nodes > 1 and not (method == "env" and "MASTER_ADDR" in environ):
        raise ConfigError(
            "a multi-node run needs DISTRIBUTED.RUN_ID (tcp: host:port of node 0; file: a shared path)"
        )
    if method == "file":
        path = (
            os.path.join(tempfile.mkdtemp(prefix="vistrain_init_"), "store") if run_id == "auto" else run_id
        )
        return f"file://{os.path.abspath(path)}"
    if method == "env" and run_id == "auto" and "MASTER_ADDR" in environ and "MASTER_PORT" in environ:
        return "env://"
    host, port = ("127.0.0.1", find_free_port()) if run_id == "auto" else _host_port(run_id)
    return f"tcp://{host}:{port}"


def _host_port(run_id: str):
    host, sep, port = run_id.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ConfigError(f"DISTRIBUTED.RUN_ID must be host:port (or auto), got {run_id!r}")
    return host, int(port)


def find_free_port() -> int:
    """A TCP port of 127.0.0.1 that nothing listens on now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


# --------------------------------------------------------------------------------------------
# running ranks


def _run_rank(local_rank: int, main_fn, cfg: CfgNode, plan: LaunchPlan, error_dir: str) -> None:
    """Body of every spawned rank: ``_start_rank``; on failure its InputError (kind and line) or
    its traceback written to ``error_dir`` for the launcher."""
    try:
        _start_rank(local_rank, main_fn, cfg, plan)
    except InputError as error:
        _write_report(
            error_dir, local_rank, INPUT_ERROR, json.dumps({"kind": error.kind, "message": str(error)})
        )
        raise
    except BaseException:
        _write_report(error_dir, local_rank, TRACEBACK, traceback.format_exc())
        raise


def _start_rank(index: int, main_fn, cfg: CfgNode, plan: LaunchPlan) -> None:
    """Body of every rank (``index``: which of this launcher's processes): device, process group, ``main_fn(cfg)``."""
    rank = plan.first_rank + index
    # the torchrun convention, also for spawned and srun ranks: per-node work (the demo data) keys on it
    os.environ["LOCAL_RANK"] = str(plan.local_rank + index)
    if plan.device == "cuda":
        torch.cuda.set_device(plan.device_index + index)  # one GPU per local rank
    elif plan.ranks_per_node > 1 and "OMP_NUM_THREADS" not in os.environ:
        # CPU ranks sharing a machine: split the cores (as torchrun does); oversubscribed OpenMP
        # threads spin against each other and can be 100x slower
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // plan.ranks_per_node))
    timeout = datetime.timedelta(seconds=plan.timeout_seconds)
    if plan.elastic_attempt is None:
        rendezvous = {"init_method": plan.init_method}
    else:  # a torchrun worker: keys of this restart attempt only (see join.attempt_store)
        rendezvous = {"store": attempt_store(os.environ, rank, plan.elastic_attempt, timeout)}
    dist.init_process_group(
        plan.backend, rank=rank, world_size=plan.world_size, timeout=timeout, **rendezvous
    )
    main_fn(cfg)
    # Only on success: tearing down after a failure can block on peers; process exit frees it.
    # The barrier first: a rank that tore down and exited while a peer still used the group
    # (rank 0 publishing the last checkpoint) could leave that peer's gloo threads to abort.
    dist.barrier()
    dist.destroy_process_group()


def _run_in_this_process(main_fn, cfg: CfgNode, plan: LaunchPlan) -> None:
    """The only rank, in the caller's process (faster start, debuggers work). The caller lives on
    (a notebook, a test suite), so the rank leaves nothing behind, also when it fails: its process
    group (a second run would find one initialised; a process forked later would inherit it and
    skip its own rendezvous) and its LOCAL_RANK."""
    local_rank = os.environ.get("LOCAL_RANK")
    try:
        _start_rank(0, main_fn, cfg, plan)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()  # one rank: no peer to wait for
        if local_rank is None:
            os.environ.pop("LOCAL_RANK", None)
        else:
            os.environ["LOCAL_RANK"] = local_rank


def _run_folder_lock(cfg: CfgNode, plan: LaunchPlan):
    """One run per CHECKPOINT.DIR: held by the process that is, or spawns, global rank 0."""
    if plan.first_rank == 0:
        return supervise.lock_run_folder(cfg.CHECKPOINT.DIR)
    return contextlib.nullcontext()


def _run_spawned_rank(local_rank: int, launcher_pid: int, main_fn, cfg, plan, error_dir: str) -> None:
    supervise.bind_to_launcher(launcher_pid)  # never outlive the launcher, leave Ctrl-C to it
    try:
        _run_rank(local_rank, main_fn, cfg, plan, error_dir)
    except BaseException:
        # Reported in error_dir; leave at once: tearing down an interpreter whose process group's
        # peers are gone can abort with C++ "terminate called" noise on the launcher's stderr.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)


def _spawn_and_watch(main_fn, cfg: CfgNode, plan: LaunchPlan) -> None:
    error_dir = tempfile.mkdtemp(prefix="vistrain-ranks-")
    try:
        with supervise.spawning_ignores_sigint():
            context = mp.start_processes(
                _run_spawned_rank,
                args=(os.getpid(), main_fn, cfg, plan, error_dir),
                nprocs=plan.local_ranks,
                join=False,
                start_method="spawn",
            )
        processes = context.processes
        try:
            failed = _wait_for_failure(processes)
        except KeyboardInterrupt:  # Ctrl-C: the ranks ignore SIGINT; stop them now, no grace
            _terminate(processes)
            raise
        except BaseException:
            _stop(processes)
            raise
        if failed:
            _stop(processes)
            raise _failure(failed, processes, error_dir, plan.first_rank)
    finally:
        shutil.rmtree(error_dir, ignore_errors=True)


def _wait_for_failure(processes) -> List[int]:
    """Block until every process exited 0 (returns []) or some exited non-zero (their indices)."""
    while True:
        running = [p.sentinel for p in processes if p.exitcode is None]
        failed = [i for i, p in enumerate(processes) if p.exitcode not in (None, 0)]
        if failed or not running:
            return failed
        multiprocessing.connection.wait(running, timeout=5.0)


def _stop(processes, grace: float = STOP_GRACE_SECONDS, escalation=(None, "terminate", "kill")) -> None:
    """Let the other ranks exit on their own for ``grace`` s, then SIGTERM, then SIGKILL."""
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
    """SIGTERM every rank, SIGKILL those still alive after ``grace`` s; return once all are gone."""
    _stop(processes, grace, escalation=("terminate", "kill"))


INPUT_ERROR, TRACEBACK = "input.json", "traceback.txt"  # what a failing rank leaves in error_dir


def _report_path(error_dir: str, local_rank: int, what: str) -> str:
    return os.path.join(error_dir, f"rank{local_rank}.{what}")


def _write_report(error_dir: str, local_rank: int, what: str, text: str) -> None:
    """A failing rank's report (``what``: INPUT_ERROR or TRACEBACK), written then renamed."""
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


def _failure(failed: List[int], processes, error_dir: str, first_rank: int) -> Exception:
    """What to raise once every rank is stopped: the first InputError any rank reported (its peers
    failing after it are consequences, whenever the launcher noticed them), else a RankFailedError."""
    inputs = _read_reports(error_dir, range(len(processes)), INPUT_ERROR)
    if inputs:
        first = json.loads(min(inputs.values())[1])
        return InputError(first["message"], kind=first["kind"])
    return RankFailedError(_failure_report(failed, processes, error_dir, first_rank))


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
