"""A rank's DataLoader workers: they leave stop signals to the rank, and they end before it exits.

A scheduler's stop signal (SIGTERM, SIGUSR1) goes to every process of a job; the rank stops at its
next iteration boundary and saves, so its workers ignore the signals
(:func:`leave_stop_signals_to_the_rank`) lest the rank's next batch fail.

That makes the interpreter's own exit hang when a rank leaves a pass unfinished (the trainer stops
early or is stopped, an exception, a monitor loader not exhausted) and its iterator is still
alive at exit (always so with persistent workers): torch's iterator does nothing once the
interpreter exits (``torch.utils.data._utils.python_exit_status``), and ``multiprocessing``'s exit
handler then sends its daemonic children SIGTERM and waits for each without a time limit. A
worker that ignores SIGTERM never ends, so neither does the rank. A rank that is itself a
``multiprocessing`` child (a spawned rank) runs no ``atexit`` handler but the same wait (its
``multiprocessing.util._exit_function``). :class:`WorkerLoader` ends its workers itself, before
those handlers: once its first workers have started it registers with ``atexit`` (which calls the
latest handler first) and as a ``multiprocessing.util.Finalize`` (run before the children are
signalled).
"""

import atexit
import multiprocessing
import multiprocessing.util
import signal
import weakref
from typing import Optional

from torch.utils.data import DataLoader

from vistrain.distributed.supervise import die_with_parent
from vistrain.torch_compat import end_loader_workers

EXIT_PRIORITY = 100  # multiprocessing's exit runs finalizers by decreasing priority, then ends children


def leave_stop_signals_to_the_rank(worker_id: int) -> None:
    """In a DataLoader worker: ignore SIGTERM and SIGUSR1, and die with the rank. A scheduler sends
    the signals to every process of the job; the rank stops at its next iteration boundary, whereas
    a worker killed by them would fail the rank's next batch. A rank that ends (a stop, a one-line
    error) leaves at once, without ending its workers: the kernel does (else they would go on
    loading the batches queued for them for seconds, holding the job's stdout and stderr). A rank
    that exits through the interpreter ends them first (:class:`WorkerLoader`)."""
    for sig in (signal.SIGTERM, signal.SIGUSR1):
        signal.signal(sig, signal.SIG_IGN)
    rank = multiprocessing.parent_process()
    if rank is not None:
        die_with_parent(rank.pid)


class WorkerLoader(DataLoader):
    """A DataLoader that ends the workers of its latest pass when the interpreter exits (see the
    module docstring), as it would if the pass had been exhausted or its iterator deleted. It holds
    its iterator and the exit handler holds the loader only weakly: a loader dropped earlier ends
    its workers then, as any DataLoader."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._pass: Optional[weakref.ref] = None  # the iterator of the latest pass with workers
        self._exit_handler = False  # registered with atexit

    def __iter__(self):
        iterator = super().__iter__()
        if self.num_workers > 0:
            self._pass = weakref.ref(iterator)
            if not self._exit_handler:  # after multiprocessing's and torch's handlers: runs before them
                end = weakref.WeakMethod(self._end_workers)
                atexit.register(_call_if_alive, end)
                multiprocessing.util.Finalize(None, _call_if_alive, (end,), exitpriority=EXIT_PRIORITY)
                self._exit_handler = True
        return iterator

    def _end_workers(self) -> None:
        """End the workers of the latest pass, if it is still alive (at exit)."""
        iterator = self._pass() if self._pass is not None else None
        if iterator is not None:
            end_loader_workers(iterator)


def _call_if_alive(method: weakref.WeakMethod) -> None:
    bound = method()
    if bound is not None:
        bound()
