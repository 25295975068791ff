"""MACHINE.CPU_MMAP_THRESHOLD_MIB: freed tensors go back to the OS instead of glibc's heaps."""

import subprocess
import sys
from pathlib import Path

import pytest

from vistrain.runtime.host_memory import set_mmap_threshold

# A freed 24 MiB block raises glibc's default threshold to 24 MiB, so the next 20 MiB tensor
# comes from the heap; a small tensor allocated after it pins the heap's top, and freeing the
# 20 MiB leaves pages the process keeps. With a fixed threshold the tensor has its own mapping.
RETAINED = """
import torch
from vistrain.fsdp.memory import current_rss_mib
from vistrain.runtime.host_memory import set_mmap_threshold
applied = set_mmap_threshold({threshold})
first = torch.ones(6 * 2**20); del first
before = current_rss_mib()
freed = torch.ones(5 * 2**20); pinned = torch.ones(1000); del freed
print(applied, current_rss_mib() - before)
"""


# The same retained 20 MiB, then the engine's trim (glibc malloc_trim): the heap pages go back.
TRIMMED = """
import torch
from vistrain.fsdp.model_state import release_free_pages
from vistrain.fsdp.memory import current_rss_mib
first = torch.ones(6 * 2**20); del first
before = current_rss_mib()
freed = torch.ones(5 * 2**20); pinned = torch.ones(1000); del freed
kept = current_rss_mib() - before
release_free_pages()
print(kept, current_rss_mib() - before)
"""

# Each scenario in its own fork of one interpreter that imported torch and vistrain: glibc's
# allocator as a fresh process's, at one torch start-up for all of them.
IN_FORKS = """
import sys
sys.path.insert(0, {tests!r})
import torch
import vistrain.fsdp.memory, vistrain.fsdp.model_state, vistrain.runtime.host_memory
from fork_each import fork_each

def scenario(name, code):
    print(name, end=" ")
    exec(code, {{}})

fork_each([(name, lambda name=name, code=code: scenario(name, code)) for name, code in {scenarios!r}])
"""


@pytest.fixture(scope="module")
def printed():
    """scenario -> what it printed (split): glibc's default and a 1 MiB threshold (RETAINED), and
    the engine's trim (TRIMMED)."""
    scenarios = [
        ("default", RETAINED.format(threshold=0)),
        ("fixed", RETAINED.format(threshold=1)),
        ("trimmed", TRIMMED),
    ]
    out = subprocess.run(
        [sys.executable, "-c", IN_FORKS.format(tests=str(Path(__file__).parent), scenarios=scenarios)],
        capture_output=True,
        text=True,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    lines = [line.split() for line in out.stdout.splitlines()]
    return {line[0]: line[1:] for line in lines}


def _retained_mib(printed, scenario):
    applied, retained = printed[scenario]
    return applied == "True", float(retained)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's allocator")
def test_fixed_threshold_gives_freed_tensors_back(printed):
    applied, retained = _retained_mib(printed, "default")
    assert not applied and retained > 15  # glibc's default: the 20 MiB stay in the heap
    applied, retained = _retained_mib(printed, "fixed")
    assert applied and retained < 2


def test_zero_means_glibc_default():
    assert set_mmap_threshold(0) is False


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's allocator")
def test_the_engines_trim_gives_freed_heap_pages_back(printed):
    kept, after_trim = map(float, printed["trimmed"])
    assert kept > 15 and after_trim < 2, (kept, after_trim)


class _CountingLibc:
    def __init__(self):
        self.trims = 0

    def malloc_trim(self, pad):
        self.trims += 1


def test_heap_release_trims_once_enough_was_freed(monkeypatch):
    from vistrain.fsdp import model_state as heap

    heap_release = heap.HeapRelease(enabled=True)
    if heap_release._libc is None:
        pytest.skip("not glibc")
    libc = _CountingLibc()
    monkeypatch.setattr(heap_release, "_libc", libc)
    heap_release.freed(heap.TRIM_AFTER_BYTES - 1)
    heap_release.at_unit_boundary()
    assert libc.trims == 0
    heap_release.freed(1)
    heap_release.at_unit_boundary()
    assert libc.trims == 1 and heap_release.freed_since_trim == 0
    disabled = heap.HeapRelease(enabled=False)
    disabled.freed(10 * heap.TRIM_AFTER_BYTES)
    disabled.at_unit_boundary()
    assert disabled._libc is None
