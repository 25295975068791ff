"""Fixtures and hooks shared by the whole suite."""

import multiprocessing

import pytest
import torch
import torch.distributed as dist


@pytest.fixture(autouse=True)
def _no_rank_outlives_its_test():
    """A rank process left behind by a timed-out or failed test would hold its port and, being a
    non-daemon child, keep pytest from exiting at the end: end it with the test."""
    yield
    for child in multiprocessing.active_children():
        child.kill()
        child.join(timeout=10)


@pytest.fixture(autouse=True)
def _no_process_group_outlives_its_test(request):
    """A default process group left in this process is inherited by every process it forks later
    (Lightning's fork launcher then skips its own rendezvous and hangs on the stale group)."""
    yield
    if dist.is_initialized():
        dist.destroy_process_group()
        pytest.fail(f"{request.node.nodeid} left the default process group initialised in pytest's process")


@pytest.fixture
def one_thread():
    """Torch on one thread for the test: tiny convolutions spend their time starting threads, and
    on a busy 2-core box oversubscription makes a 30 ms forward take seconds."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
