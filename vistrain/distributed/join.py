"""Joining a job somebody else started: torchrun (or any elastic agent) and srun (SLURM).

Both start one process per rank themselves, so the launcher must not spawn; it only reads who this
process is. The job decides the layout (world size, ranks per node, rendezvous): ``DISTRIBUTED.*``
keys that describe a different layout are ignored and named in one note (a recipe written for the
spawn launcher, e.g. ``NUM_PROC_PER_NODE: 2``, runs unchanged under ``torchrun --nproc_per_node 8``).
An environment that cannot describe a job (a torchrun variable without its partners, an srun task
without a node list) is a ConfigError before anything starts.

* torchrun sets ``RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, GROUP_WORLD_SIZE (nodes),
  MASTER_ADDR, MASTER_PORT``; its rendezvous (standalone or c10d) is joined through ``env://``.
* srun sets ``SLURM_PROCID`` (global rank), ``SLURM_LOCALID`` (rank on the node), ``SLURM_NTASKS``
  (world size), ``SLURM_NNODES``, ``SLURM_TASKS_PER_NODE`` (``"8(x2),4"``), ``SLURM_JOB_NODELIST``
  and ``SLURM_JOB_ID``. Every task derives the same rendezvous from the job:
  ``tcp://<first host of the node list>:<20000 + job id mod 20000>`` unless ``DISTRIBUTED.RUN_ID``
  (tcp host:port, or a shared file with ``INIT_METHOD=file``) or ``INIT_METHOD=env`` with exported
  ``MASTER_ADDR``/``MASTER_PORT`` chooses it. One task (``SLURM_NTASKS=1``) is not a joined job: the
  launcher spawns ``NUM_PROC_PER_NODE`` ranks inside it as on any machine.
"""

import dataclasses
import datetime
import re
from typing import Mapping, Optional, Tuple

import torch.distributed as dist
from fvcore.common.config import CfgNode

from vistrain.config.loader import ConfigError
from vistrain.config.words import plural

TORCHRUN_KEYS = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
SLURM_PORT_BASE = 20000  # srun rendezvous port: SLURM_PORT_BASE + job id % SLURM_PORT_SPAN
SLURM_PORT_SPAN = 20000


@dataclasses.dataclass(frozen=True)
class JoinedJob:
    """This process' place in a job started by torchrun or srun."""

    scheduler: str  # "torchrun" | "srun"
    world_size: int
    rank: int  # global rank of this process
    local_rank: int  # rank among the processes on this node
    ranks_per_node: int  # processes on this node
    num_nodes: int
    init_method: str  # env:// | tcp://host:port | file://path
    notes: Tuple[str, ...] = ()  # DISTRIBUTED keys ignored because the job decides
    elastic_attempt: Optional[int] = None  # torchrun: how many times the worker group was restarted


def joined_job(dist_cfg: CfgNode, environ: Mapping[str, str]) -> Optional[JoinedJob]:
    """The job this process belongs to, or None when the launcher should spawn the ranks itself."""
    if "RANK" in environ or "WORLD_SIZE" in environ:
        job = _torchrun_job(environ)
    elif "SLURM_PROCID" in environ and _int(environ, "SLURM_NTASKS", "1") > 1:
        job = _slurm_job(dist_cfg, environ)
    else:
        return None
    if not 0 <= job.rank < job.world_size or not 0 <= job.local_rank < job.ranks_per_node:
        raise ConfigError(
            f"{job.scheduler} reports rank {job.rank} of {job.world_size} and local rank "
            f"{job.local_rank} of {job.ranks_per_node}: inconsistent job environment"
        )
    return dataclasses.replace(job, notes=_ignored_keys(dist_cfg, job))


def first_slurm_host(nodelist: str) -> str:
    """First host of a SLURM node list: "gpu[003-005,9],cpu1" -> "gpu003"."""
    head = nodelist.strip()
    depth = 0
    for i, ch in enumerate(head):
        depth += ch == "["
        depth -= ch == "]"
        if ch == "," and depth == 0:
            head = head[:i]
            break
    if "[" not in head:
        return head
    prefix, ranges = head.split("[", 1)
    return prefix + ranges.rstrip("]").split(",")[0].split("-")[0]


def slurm_tasks_on_node(tasks_per_node: str, node_id: int) -> int:
    """Tasks SLURM placed on node ``node_id``: ``SLURM_TASKS_PER_NODE`` "2(x3),1" -> 2 for nodes 0-2, 1 for 3."""
    first = 0
    for item in tasks_per_node.split(","):
        match = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", item.strip())
        if match is None:
            raise ConfigError(f"cannot read SLURM_TASKS_PER_NODE={tasks_per_node!r}")
        count, repeat = int(match.group(1)), int(match.group(2) or 1)
        if node_id < first + repeat:
            return count
        first += repeat
    raise ConfigError(f"SLURM_TASKS_PER_NODE={tasks_per_node!r} lists no node {node_id}")


# --------------------------------------------------------------------------------------------
# reading the environment


def _int(environ: Mapping[str, str], key: str, default: Optional[str] = None) -> int:
    value = environ.get(key, default)
    if value is None:
        raise ConfigError(f"{key} is not set; the job environment is incomplete")
    try:
        return int(value)
    except ValueError:
        raise ConfigError(f"{key}={value!r} is not an integer") from None


def _torchrun_job(environ: Mapping[str, str]) -> JoinedJob:
    missing = [k for k in TORCHRUN_KEYS if k not in environ]
    if missing:
        raise ConfigError(
            f"incomplete torchrun environment: {', '.join(missing)} not set (RANK, WORLD_SIZE, "
            f"MASTER_ADDR and MASTER_PORT come together)"
        )
    world, local = _int(environ, "WORLD_SIZE"), _int(environ, "LOCAL_RANK", "0")
    per_node = _int(environ, "LOCAL_WORLD_SIZE", str(world))
    nodes = _int(environ, "GROUP_WORLD_SIZE", str(max(1, world // per_node)))
    attempt = _int(environ, "TORCHELASTIC_RESTART_COUNT") if "TORCHELASTIC_RESTART_COUNT" in environ else None
    return JoinedJob("torchrun", world, _int(environ, "RANK"), local, per_node, nodes, "env://", (), attempt)


def attempt_store(environ: Mapping[str, str], rank: int, attempt: int, timeout: datetime.timedelta):
    """The torchrun rendezvous store, seen through a prefix unique to this restart ``attempt``.

    torchrun's agent keeps one TCPStore across restarts of the worker group and hands every
    attempt the same MASTER_ADDR:MASTER_PORT; ``env://`` would then read the previous attempt's
    keys (the dead group's gloo/NCCL addresses) and fail to connect (pytorch/pytorch#135712).
    All agents restart their workers together, so TORCHELASTIC_RESTART_COUNT agrees across ranks.
    """
    agent_serves = environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    store = dist.TCPStore(
        environ["MASTER_ADDR"],
        int(environ["MASTER_PORT"]),
        is_master=rank == 0 and not agent_serves,  # without the agent's store, rank 0 hosts it
        timeout=timeout,
        multi_tenant=True,
    )
    return dist.PrefixStore(f"vistrain/attempt_{attempt}/", store)


def _slurm_job(dist_cfg: CfgNode, environ: Mapping[str, str]) -> JoinedJob:
    world = _int(environ, "SLURM_NTASKS")
    nodes = _int(environ, "SLURM_NNODES", environ.get("SLURM_JOB_NUM_NODES", "1"))
    if "SLURM_TASKS_PER_NODE" in environ:
        per_node = slurm_tasks_on_node(environ["SLURM_TASKS_PER_NODE"], _int(environ, "SLURM_NODEID", "0"))
    else:
        per_node = -(-world // nodes)  # an even spread, rounded up
    rank, local = _int(environ, "SLURM_PROCID"), _int(environ, "SLURM_LOCALID", "0")
    return JoinedJob("srun", world, rank, local, per_node, nodes, _slurm_rendezvous(dist_cfg, environ))


def _slurm_rendezvous(dist_cfg: CfgNode, environ: Mapping[str, str]) -> str:
    method, run_id = dist_cfg.INIT_METHOD, dist_cfg.RUN_ID
    if method == "env":
        if "MASTER_ADDR" not in environ or "MASTER_PORT" not in environ:
            raise ConfigError(
                "DISTRIBUTED.INIT_METHOD=env under srun needs MASTER_ADDR and MASTER_PORT exported"
            )
        return "env://"
    if method == "file":
        if run_id == "auto":
            raise ConfigError("DISTRIBUTED.INIT_METHOD=file under srun needs RUN_ID: a path every node sees")
        return f"file://{run_id}"
    if method != "tcp":
        raise ConfigError(f"DISTRIBUTED.INIT_METHOD must be tcp, env or file, got {method!r}")
    if run_id != "auto":
        host, sep, port = run_id.rpartition(":")
        if not sep or not host or not port.isdigit():
            raise ConfigError(f"DISTRIBUTED.RUN_ID must be host:port (or auto), got {run_id!r}")
        return f"tcp://{host}:{port}"
    if "SLURM_JOB_NODELIST" not in environ:
        raise ConfigError(
            "SLURM_JOB_NODELIST is not set: cannot find the rendezvous host (set DISTRIBUTED.RUN_ID)"
        )
    # every task computes the same address: the job's first node, a port from the job id
    host = first_slurm_host(environ["SLURM_JOB_NODELIST"])
    port = SLURM_PORT_BASE + _int(environ, "SLURM_JOB_ID") % SLURM_PORT_SPAN
    return f"tcp://{host}:{port}"


def _ignored_keys(dist_cfg: CfgNode, job: JoinedJob) -> Tuple[str, ...]:
    """One note naming the DISTRIBUTED keys the job overrides (empty when they agree)."""
    ignored = []
    asked = (dist_cfg.NUM_NODES, dist_cfg.NUM_PROC_PER_NODE)
    if asked != (job.num_nodes, job.ranks_per_node):
        ignored += [f"NUM_NODES={dist_cfg.NUM_NODES}", f"NUM_PROC_PER_NODE={dist_cfg.NUM_PROC_PER_NODE}"]
    if dist_cfg.NODE_ID != 0:
        ignored.append(f"NODE_ID={dist_cfg.NODE_ID}")
    if job.scheduler == "torchrun":  # torchrun's rendezvous is the only one its workers can use
        if dist_cfg.INIT_METHOD == "file":  # tcp (the default) and env both mean "torchrun's" here
            ignored.append(f"INIT_METHOD={dist_cfg.INIT_METHOD}")
        if dist_cfg.RUN_ID != "auto":
            ignored.append(f"RUN_ID={dist_cfg.RUN_ID}")
    if not ignored:
        return ()
    return (
        f"{job.scheduler} decides the layout ({plural(job.num_nodes, 'node')}, {plural(job.ranks_per_node, 'rank')} on this "
        f"node, world size {job.world_size}, rendezvous {job.init_method}); ignoring DISTRIBUTED."
        + ", ".join(ignored),
    )
