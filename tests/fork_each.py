"""Jobs run one after another, each in its own fork of the calling interpreter: a fresh process
imports torch once, and no job's memory blurs the next one's measurement."""

import os
import sys
import traceback


def fork_each(jobs) -> None:
    """Run every ``(name, fn)`` of ``jobs`` as ``fn()`` in a fork of this process, in order; exit
    naming the first job that fails (its traceback on stderr)."""
    for name, fn in jobs:
        pid = os.fork()
        if pid == 0:
            try:
                fn()
                sys.stdout.flush()
                os._exit(0)
            except BaseException:
                traceback.print_exc()
                os._exit(1)
        if os.waitpid(pid, 0)[1] != 0:
            sys.exit(name + " failed")
