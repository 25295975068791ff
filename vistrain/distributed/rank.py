"""One rank of a job: what it is (:class:`LaunchPlan`), its start (:func:`start_rank`), and how a
job that every rank started itself (torchrun, srun) reports a problem in one line, not one per rank.

In a joined job every rank runs the command line, checks the input and may find it wrong. A rank
that finds a problem before the start still meets the others (:func:`meet_and_refuse`): the first
thing every rank does once the process group exists is to exchange what it found
(:func:`agree_to_start`), so that all of them raise the same error and global rank 0 alone prints
it. A problem found once the job runs is printed by global rank 0; another rank prints its own only
when rank 0 has not reported one within :data:`REPORT_WAIT_SECONDS` (:func:`report_for_job`):
it alone saw it, e.g. an unreadable image in its part of the data.
"""

import contextlib
import dataclasses
import datetime
import os
import sys
import time
from typing import Iterator, Mapping, Optional, Tuple

import torch
import torch.distributed as dist
from fvcore.common.config import CfgNode

from vistrain import torch_compat
from vistrain.config.errors import OneLineExit, StopRequested, rebuilt
from vistrain.config.job_env import job_rank
from vistrain.distributed import comm
from vistrain.distributed.join import attempt_store
from vistrain.distributed.stop_signals import StopSignals, signal_name

REPORT_WAIT_SECONDS = 3.0  # how long a rank other than 0 waits to see rank 0 report a problem
_REPORTED_KEY = "vistrain/rank0_reported"  # in the job's rendezvous store


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


def start_rank(
    index: int, main_fn, cfg: CfgNode, plan: LaunchPlan, announce=None, refused: Optional[OneLineExit] = None
) -> None:
    """Body of every rank (``index``: which of this launcher's processes): device, process group,
    ``main_fn(cfg)``, with stop signals handled (``announce``: see ``launch``). ``refused``:
    this rank's error found before the start, exchanged with the other ranks of a joined job."""
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
    # a rank meeting the others only to refuse keeps the default: a signal ends it at once, even
    # while it waits in the rendezvous for a rank 0 that is gone
    stop = StopSignals(cfg.CHECKPOINT.STOP_GRACE_SECONDS, announce) if refused is None else None
    with stop or contextlib.nullcontext():
        dist.init_process_group(
            plan.backend, rank=rank, world_size=plan.world_size, timeout=timeout, **rendezvous
        )
        if not plan.spawn:  # every rank of a joined job checked the input itself
            agree_to_start(refused)
        try:
            main_fn(cfg)
        except Exception as error:
            if stop is None or not stop.received or isinstance(error, OneLineExit):
                raise
            # a peer that stopped or gave up first broke this rank's collective: part of the stop
            raise StopRequested(f"{signal_name(stop.received)}: every rank stopped") from None
        # Only on success: tearing down after a failure can block on peers; process exit frees it.
        # The barrier first: a rank that tore down and exited while a peer still used the group
        # (rank 0 publishing the last checkpoint) could leave that peer's gloo threads to abort.
        dist.barrier()
        dist.destroy_process_group()


def agree_to_start(refused: Optional[OneLineExit]) -> None:
    """Collective, first thing in a joined job: raise the first rank's pre-start error (in rank
    order) on every rank, so that the job reports it once."""
    reports = comm.all_gather_object(
        None if refused is None else (refused.kind, str(refused), refused.exit_code)
    )
    first = next((report for report in reports if report is not None), None)
    if first is not None:
        raise rebuilt(*first, agreed=True)


def meet_and_refuse(error: OneLineExit, cfg: CfgNode, plan: LaunchPlan) -> bool:
    """This rank of a joined job found the input wrong before the start (``error``): meet the other
    ranks so that the job agrees on one error. True when they met (every rank raises the first
    error in rank order, which global rank 0 prints); False when this rank could not reach them
    (the rendezvous timed out: rank 0 never came), so that it reports its own."""
    try:
        start_rank(0, None, cfg, plan, refused=error)
    except OneLineExit:
        return True
    except Exception:  # no rendezvous
        return False
    return True  # not reached: agree_to_start raises


def report_for_job(line: str, environ: Mapping[str, str], agreed: bool = False) -> None:
    """Print ``line`` (stderr) if this process speaks for the job about the problem it ends with.

    The launcher (or global rank 0 of a joined job) always does, then says so in the job's store.
    Another rank of a joined job waits up to REPORT_WAIT_SECONDS for that (so that a scheduler
    ending the job when the first rank exits does not cut rank 0's line) and stays quiet, unless
    the problem is its own (not ``agreed`` by every rank in a collective) and rank 0 reported
    nothing: it alone saw it. A store that cannot be asked went with rank 0, after its line.
    """
    rank = job_rank(environ)
    store = torch_compat.default_store() if comm.is_dist() else None
    if rank == 0 or store is None:  # not started: a problem with this rank's own environment
        print(line, file=sys.stderr, flush=True)
        if store is not None:
            with contextlib.suppress(Exception), _quiet_stderr():  # the store's host is gone: nobody asks
                store.set(_REPORTED_KEY, "1")
        return
    if not (_rank0_reported(store) or agreed):
        print(line, file=sys.stderr, flush=True)


def _rank0_reported(store) -> bool:
    deadline = time.monotonic() + REPORT_WAIT_SECONDS
    try:
        while time.monotonic() < deadline:
            with _quiet_stderr():
                if store.check([_REPORTED_KEY]):
                    return True
            time.sleep(0.05)
    except Exception:  # its host (rank 0) is gone
        return True
    return False


@contextlib.contextmanager
def _quiet_stderr() -> Iterator[None]:
    """File descriptor 2 to /dev/null: a TCPStore whose host died logs a C++ stack on stderr
    before it raises, and this rank's question has a plain answer (rank 0 is gone)."""
    sys.stderr.flush()
    saved, null = os.dup(2), os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(null, 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(null)
