"""Stopping a training run at an iteration boundary when its job is asked to end (SIGTERM, SIGUSR1).

The loop asks :meth:`BoundaryStop.requested` at every boundary where a checkpoint could be saved
(after an optimizer step). The ranks agree there in one all-reduce (MAX) of one integer: the stop
signal any rank received (0: none). It runs on a gloo group on the CPU, so under NCCL it never
waits for the GPU's queue; measured with ``dev/bench/bench_stop_check.py``. A signal that reaches only
one rank (or only the launcher, which forwards it) therefore stops every rank at the same
iteration. :meth:`BoundaryStop.save_and_stop` then saves ``checkpoint_<iteration>`` (unless that
iteration is already saved), optionally requeues the SLURM job, and raises StopRequested on every
rank: the launcher prints one line naming the checkpoint and exits 143. The rerun resumes there
and loses no iteration. The signals themselves are handled by
:class:`vistrain.distributed.stop_signals.StopSignals` (installed by the launcher), which also
abandons a step that cannot finish within ``CHECKPOINT.STOP_GRACE_SECONDS``.
"""

import os
import subprocess
from typing import Callable, NoReturn, Optional

import torch
import torch.distributed as dist

from vistrain.checkpoint.files import checkpoint_name
from vistrain.config.errors import StopRequested
from vistrain.distributed import comm
from vistrain.distributed.stop_signals import StopSignals, signal_name

REQUEUE_TIMEOUT_SECONDS = 20.0


class BoundaryStop:
    """Created by every rank before the training loop (collective under NCCL: a gloo group)."""

    def __init__(self, cfg, total_iterations: int):
        self.signals = StopSignals.installed()  # None when train() runs outside the launcher
        if self.signals is not None:
            self.signals.defer()
        self.total = total_iterations
        self.requeue = cfg.CHECKPOINT.SLURM_REQUEUE
        self.signum = 0  # the stop signal the ranks agreed on
        self.flag = torch.zeros(1, dtype=torch.int32)
        self.group = None
        if comm.get_world_size() > 1 and dist.get_backend() != "gloo":
            self.group = dist.new_group(backend="gloo")  # a CPU flag: no wait for the GPU

    def requested(self) -> bool:
        """Collective, at every checkpoint boundary on every rank: whether any rank received a stop
        signal so far (the same answer on every rank)."""
        self.flag.fill_(self.signals.received if self.signals is not None else 0)
        comm.all_reduce_max(self.flag, self.group)
        self.signum = int(self.flag.item())
        return self.signum > 0

    def save_and_stop(self, iteration: int, saved_at: int, save: Callable[[], object]) -> NoReturn:
        """Collective: save ``checkpoint_<iteration>`` with ``save()`` (not when ``saved_at`` is
        this iteration already), requeue the SLURM job if asked, raise StopRequested everywhere."""
        if saved_at != iteration:
            save()
        note = _requeue() if self.requeue and comm.is_main_process() else ""
        note = comm.all_gather_object(note)[0]  # every rank's line says the same
        raise StopRequested(
            f"{signal_name(self.signum)} at iteration {iteration} of {self.total}: every rank stopped and "
            f"saved {checkpoint_name(iteration)}{note}",
            agreed=True,
        )


def _requeue() -> str:
    """Put this SLURM job back in the queue (``scontrol requeue $SLURM_JOB_ID``); what happened."""
    job = os.environ.get("SLURM_JOB_ID")
    if not job:
        return "; CHECKPOINT.SLURM_REQUEUE: not a SLURM job (no SLURM_JOB_ID), nothing requeued"
    try:
        done = subprocess.run(
            ["scontrol", "requeue", job], capture_output=True, text=True, timeout=REQUEUE_TIMEOUT_SECONDS
        )
    except (OSError, subprocess.TimeoutExpired) as error:
        return f"; scontrol requeue {job} failed ({_first_line(str(error))})"
    if done.returncode != 0:
        return f"; scontrol requeue {job} failed ({_first_line(done.stderr or done.stdout)})"
    return f"; requeued SLURM job {job}"


def _first_line(text: Optional[str]) -> str:
    lines = (text or "").strip().splitlines()
    return lines[0][:200] if lines else "no message"
