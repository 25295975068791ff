"""Giving the engine's freed buffers back to the OS on CPU ranks (glibc's ``malloc_trim``).

glibc maps an allocation on its own (and unmaps it when freed) only above its mmap threshold,
which starts at 128 KiB and grows to the size of each mapped block freed, up to 32 MiB. After
the first freed layers every block up to 32 MiB comes from the heaps (one arena per thread:
gloo's threads add theirs), and a heap keeps the pages of freed blocks. A sharded run frees and
re-allocates gathered weights and full gradients unit after unit, so a rank's resident memory
grows by hundreds of MiB that no tensor holds. ``malloc_trim(0)`` returns every free page of
every arena; the engine calls it at unit boundaries once it has freed enough since the last
call, so its cost (a walk over the arenas' free lists, then the page faults when the pages are
used again) is paid every few units of a big model and every few steps of a small one. Each unit
also trims once when it is built: building a unit materialises its parameters and a padded flat
copy, which otherwise leave the heaps at almost the training peak before the first step. Fixing the threshold instead (``MACHINE.CPU_MMAP_THRESHOLD_MIB``) returns memory at
every free, at the price of a page fault storm on every large allocation.
"""

import ctypes
import platform
from typing import Optional

# Freed since the last trim: the quick start's model is trimmed every few steps, a big model's
# every unit or two (step-time A/B in docs/memory.md).
TRIM_AFTER_BYTES = 256 * 2**20


def _glibc() -> Optional[ctypes.CDLL]:
    if platform.libc_ver()[0] != "glibc":
        return None
    return ctypes.CDLL("libc.so.6")  # glibc's soname; find_library would spawn ldconfig per call


def release_free_pages() -> None:
    """Return every free heap page to the OS now (glibc; a no-op elsewhere)."""
    libc = _glibc()
    if libc is not None:
        libc.malloc_trim(0)


class HeapRelease:
    """Counts the bytes the engine frees and trims glibc's heaps at the next unit boundary once
    they reach ``TRIM_AFTER_BYTES``. Does nothing when disabled or not on glibc."""

    def __init__(self, enabled: bool):
        self._libc = _glibc() if enabled else None
        self.freed_since_trim = 0
        self.trims = 0

    def freed(self, nbytes: int) -> None:
        self.freed_since_trim += nbytes

    def at_unit_boundary(self) -> None:
        if self._libc is None or self.freed_since_trim < TRIM_AFTER_BYTES:
            return
        self._libc.malloc_trim(0)
        self.freed_since_trim = 0
        self.trims += 1
