"""A real launcher for the process tests of test_run_folder.py, kept light to start (no trainer,
no torchvision: the launcher and both spawned ranks import this module).

    python tests/run_folder_job.py RUN_DIR

runs 2 CPU ranks that write their pids (and ``ready<rank>`` once looping) to RUN_DIR and loop on all-reduces until stopped, through the command
line's launcher (``vistrain.cli.run``: exit codes and messages as tools/run_distributed.py).
"""

import os
import signal
import sys
import time
from pathlib import Path

import torch

from vistrain import cli
from vistrain.methods import load_config


def collectives_forever(cfg):
    """Write this rank's pid, then all-reduce until stopped (only the launcher ends this job);
    ``ready<rank>`` once the first all-reduce is done: every rank is in the loop."""
    import torch.distributed as dist

    Path(cfg.CHECKPOINT.DIR, f"pid{dist.get_rank()}").write_text(str(os.getpid()))
    dist.all_reduce(torch.ones(1))
    Path(cfg.CHECKPOINT.DIR, f"ready{dist.get_rank()}").touch()
    while True:
        dist.all_reduce(torch.ones(1))
        time.sleep(0.1)


if __name__ == "__main__":
    # Ctrl-C as in a terminal, even where the test runner was started in the background (a
    # non-interactive shell starts background jobs with SIGINT ignored, and Python keeps that)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    job = load_config(
        [
            "config.MACHINE.DEVICE=cpu",
            "config.DISTRIBUTED.NUM_PROC_PER_NODE=2",
            f"config.CHECKPOINT.DIR={sys.argv[1]}",
        ]
    )
    sys.exit(cli.run(collectives_forever, job))
