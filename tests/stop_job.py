"""A real training job for the stop-signal tests (test_preemption.py): the tiny recipe through the
command line's launcher (``vistrain.cli.run``: its exit codes and lines), with test hooks in every
rank (the spawned ones import this module; under torchrun and srun every rank runs it).

    python tests/stop_job.py [config.KEY=VALUE ...]

Environment: ``STOP_JOB_STEP_SECONDS`` sleeps this long in every optimizer step (a window for the
test to send a signal in); ``STOP_JOB_HANG_AT=N`` makes rank 0 hang in the step of iteration N (a
step that cannot finish within the grace), after writing ``hanging0``. Every rank writes
``pid<rank>`` into the run folder.
"""

import os
import sys
import time
from pathlib import Path

from vistrain import cli
from vistrain.methods import load_config


def hooked_train(cfg, notes=()):
    """``train(cfg)`` with this job's hooks (module level: spawned ranks unpickle it from here)."""
    from vistrain.distributed import comm
    from vistrain.training import trainer

    rank = comm.get_rank()
    Path(cfg.CHECKPOINT.DIR).mkdir(parents=True, exist_ok=True)
    Path(cfg.CHECKPOINT.DIR, f"pid{rank}").write_text(str(os.getpid()))
    step = trainer._optimizer_step
    delay = float(os.environ.get("STOP_JOB_STEP_SECONDS", "0"))
    hang_at = int(os.environ.get("STOP_JOB_HANG_AT", "-1"))

    def hooked_step(model, criterion, optimizer, settings, iteration):
        if iteration == hang_at and rank == 0:
            Path(cfg.CHECKPOINT.DIR, "hanging0").touch()  # the test signals only once this exists
            time.sleep(3600)
        time.sleep(delay)
        step(model, criterion, optimizer, settings, iteration)

    trainer._optimizer_step = hooked_step
    trainer.train(cfg, notes)


if __name__ == "__main__":
    sys.exit(
        cli.run(
            hooked_train, load_config(["config=test/simclr_tiny", "config.LOG_FREQUENCY=1", *sys.argv[1:]])
        )
    )
