"""Fixtures and hooks shared by the whole suite."""

import multiprocessing

import pytest


@pytest.fixture(autouse=True)
def _no_rank_outlives_its_test():
    """A rank process left behind by a timed-out or failed test would hold its port and, being a
    non-daemon child, keep pytest from exiting at the end: end it with the test."""
    yield
    for child in multiprocessing.active_children():
        child.kill()
        child.join(timeout=10)
