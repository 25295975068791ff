"""Start the ranks of a run: join torchrun / SLURM (see ``join.py``), or spawn local processes and watch them.

``launch(main_fn, cfg)`` always ends with ``main_fn(cfg)`` running on every rank inside an
initialised process group (also for a single process), so the engine never special-cases
"not distributed". When the launcher spawns the ranks itself it watches them: as soon as one rank
exits non-zero (an exception, a SIGKILL, the OOM killer) the others are stopped and
:class:`RankFailedError` carries the failing rank's traceback; a rank that ended in one line
(:class:`~vistrain.config.OneLineExit`: the user's input is wrong, the run diverged, a stop signal)
has it raised again in the launcher instead. A dead rank therefore never leaves its peers waiting
in a collective until the timeout. SIGTERM and SIGUSR1 stop every rank at an iteration boundary
with a checkpoint (``stop_signals.py``), whichever process of the job receives them.

In a joined job (torchrun, srun) every rank runs the command line itself; a rank that finds the
input wrong before the job starts still meets the others (:func:`launch_refused`), so that the job
agrees on one line, which global rank 0 prints.
"""

import contextlib
import os
import random
import socket
import sys
import tempfile
from typing import Callable, Mapping, Optional

import torch
import torch.distributed as dist
from fvcore.common.config import CfgNode

from vistrain.config.checks import DEVICES, DIST_BACKENDS, INIT_METHODS, check_world_size
from vistrain.config.defaults import get_defaults
from vistrain.config.errors import ConfigError, OneLineExit
from vistrain.config.job_env import job_rank
from vistrain.distributed import supervise
from vistrain.distributed.join import (  # noqa: F401  first_slurm_host: public here too
    first_slurm_host,
    joined_job,
)
from vistrain.distributed.network import check_gloo_interface
from vistrain.distributed.rank import (
    LaunchPlan,
    meet_and_refuse,
    report_for_job,
    start_rank,
)
from vistrain.distributed.spawn import RankFailedError, spawn_and_watch  # noqa: F401  public here too

PORT_RANGE_START = 20000  # the launcher's own rendezvous ports: [20000, the ephemeral range)

# --------------------------------------------------------------------------------------------
# public API


def launch(
    main_fn: Callable[[CfgNode], object], cfg: CfgNode, announce: Optional[Callable[[str], None]] = None
) -> None:
    """Run ``main_fn(cfg)`` on every rank of the job described by ``cfg.DISTRIBUTED``.

    ``main_fn`` must be a module-level function (it is pickled for spawned processes).
    ``announce(detail)``: prints the job's line when a stop signal's grace runs out in the process
    that reports for the job (see ``stop_signals``).
    Raises ConfigError (before anything starts) for impossible settings, RunFolderBusyError when
    another run holds ``CHECKPOINT.DIR``, the OneLineExit of a rank that ended in one line
    (every rank stopped: InputError, DivergedError, StopRequested), and RankFailedError when a
    spawned rank fails otherwise.
    """
    plan = plan_launch(cfg.DISTRIBUTED, cfg.MACHINE, os.environ)
    check_world_size(cfg, plan.world_size)  # hybrid sharding's groups must tile the job
    check_gloo_interface(plan.backend, plan.world_size > plan.ranks_per_node, plan.init_method, os.environ)
    _print_notes(plan)
    with _run_folder_lock(cfg, plan):
        if not plan.spawn:  # one rank of a joined job
            start_rank(0, main_fn, cfg, plan, announce if plan.first_rank == 0 else None)
        elif plan.local_ranks == 1:
            _run_in_this_process(main_fn, cfg, plan, announce)
        else:
            spawn_and_watch(main_fn, cfg, plan)


def refuse_in_job(error: OneLineExit, cfg: Optional[CfgNode]) -> None:
    """Print ``error``, found before the job started, once per job. The launcher and global rank
    0 print it at once; another rank of a joined job first meets the others (with the defaults'
    DISTRIBUTED settings where its config did not load) so that the job agrees on one line
    (:func:`vistrain.distributed.rank.meet_and_refuse`), and prints only when it cannot reach them."""
    cfg = cfg if cfg is not None else get_defaults()
    try:
        plan = None if job_rank(os.environ) == 0 else plan_launch(cfg.DISTRIBUTED, cfg.MACHINE, os.environ)
    except ConfigError:  # the job environment itself is wrong: each rank says so
        plan = None
    met = plan is not None and not plan.spawn and meet_and_refuse(error, cfg, plan)
    report_for_job(error.line(), os.environ, agreed=met)


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
            f"{needed} ranks on this machine need {needed} GPUs; {torch.cuda.device_count()} visible: set "
            f"DISTRIBUTED.NUM_PROC_PER_NODE={torch.cuda.device_count()} or MACHINE.DEVICE=cpu"
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
    """A TCP port nothing is bound to now, drawn below the system's ephemeral range: a port the
    kernel hands out (``bind`` to port 0, outgoing connections) could be taken by any process,
    such as another job's gloo connections, before the rendezvous binds it."""
    draw = random.SystemRandom()  # not the seeded ``random``: every process would draw alike
    low = _ephemeral_low()
    for _ in range(64 if low - PORT_RANGE_START >= 1000 else 0):
        port = draw.randrange(PORT_RANGE_START, low)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            try:
                sock.bind(("", port))
            except OSError:
                continue
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("", 0))
        return sock.getsockname()[1]


def _ephemeral_low() -> int:
    """The first port of the kernel's ephemeral range (Linux; else IANA's 49152)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 49152


# --------------------------------------------------------------------------------------------
# running ranks


def _run_in_this_process(main_fn, cfg: CfgNode, plan: LaunchPlan, announce) -> None:
    """The only rank, in the caller's process (faster start, debuggers work). The caller lives on
    (a notebook, a test suite), so the rank leaves nothing behind, also when it fails: its process
    group (a second run would find one initialised; a process forked later would inherit it and
    skip its own rendezvous) and its LOCAL_RANK."""
    local_rank = os.environ.get("LOCAL_RANK")
    try:
        start_rank(0, main_fn, cfg, plan, announce)
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
