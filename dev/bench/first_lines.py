"""Prints the quick start's output lines, timed, and how the run stops on SIGTERM.

What a new user sees first, timed: the quick start's lines and how it stops on SIGTERM.

    python dev/bench/first_lines.py [--stop-at-iteration 12] [recipe overrides ...]

Runs ``tools/run_distributed.py config=regnet_fsdp`` (with the overrides) in a fresh run folder,
prints every stdout line with the seconds since the command started, sends SIGTERM to the
launcher once the progress line of ``--stop-at-iteration`` (or a later one) is printed, and prints
the seconds from the signal to the exit, the exit code and stderr (the job's one line).
"""

import argparse
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PROGRESS = re.compile(r" it (\d+)/\d+ ")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stop-at-iteration", type=int, default=12)
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        command = [
            sys.executable,
            str(REPO / "tools" / "run_distributed.py"),
            "config=regnet_fsdp",
            f"config.CHECKPOINT.DIR={tmp}/run",
            *args.overrides,
        ]
        start = time.monotonic()
        job = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        sent = None
        for line in job.stdout:
            print(f"{time.monotonic() - start:6.1f} s  {line.rstrip()}", flush=True)
            reached = PROGRESS.search(line)
            if sent is None and reached and int(reached.group(1)) >= args.stop_at_iteration:
                job.send_signal(signal.SIGTERM)
                sent = time.monotonic()
        code = job.wait()
        took = f"{time.monotonic() - sent:.1f} s after SIGTERM" if sent is not None else "without a signal"
        print(f"exit {code}, {took}; stderr:")
        print(job.stderr.read(), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
