"""Host (CPU) memory that freed tensors really give back: glibc's mmap threshold.

glibc serves an allocation from its heaps unless it is at least ``M_MMAP_THRESHOLD`` bytes, in
which case it gets its own mapping that ``free`` returns to the OS at once. The threshold starts
at 128 KiB and, by default, grows to the size of every mapped block freed, up to 32 MiB: after the
first few freed layers, every tensor of up to 32 MiB lives in the heaps, and a heap keeps the
pages of freed blocks it cannot trim (any later block above them pins them). A sharded run frees
and re-allocates full weights and gradients unit after unit, so the process grows by memory that
no tensor holds. Fixing the threshold costs page faults (each large tensor is zero-filled by the
kernel again). Both sides are measured by ``dev/bench/bench_big_model.py`` (peak RSS) and
``dev/bench/bench_host_memory.py`` (step time); their numbers: docs/notes/memory.md.
"""

import ctypes
import ctypes.util
import platform

M_MMAP_THRESHOLD = -3  # mallopt parameter number, from glibc's malloc.h


def set_mmap_threshold(mib: float) -> bool:
    """Have glibc map every allocation of at least ``mib`` MiB on its own (and unmap it when
    freed), with no dynamic adjustment. Returns False (and changes nothing) when ``mib`` <= 0 or
    the C library is not glibc."""
    if mib <= 0 or platform.libc_ver()[0] != "glibc":
        return False
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    return bool(libc.mallopt(M_MMAP_THRESHOLD, int(mib * 2**20)))
