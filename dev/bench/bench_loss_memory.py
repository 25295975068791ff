"""Prints the peak memory that LeJEPA's, Barlow Twins' and VICReg's losses add in forward and
backward, as a multiple of their largest tensor (what the planner counts for them).

Each case runs in a fork of this process: embeddings (V*N, D) from a linear layer, then the loss
of one process and its backward; the case's peak RSS over the RSS before it, against the loss's
largest tensor: LeJEPA's (V, N, M, K) characteristic-function arguments (M slices, K = 17 knots),
Barlow Twins' and VICReg's (D, D) matrices, all fp32. The methods' ``loss_memory`` uses the
multiples (``vistrain/methods/lejepa.py``, ``barlow_twins.py``, ``vicreg.py``).

    python dev/bench/bench_loss_memory.py
"""

import gc
import os
import resource
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from vistrain.losses.barlow_twins import barlow_twins_loss
from vistrain.losses.lejepa import lejepa_loss
from vistrain.losses.vicreg import vicreg_loss

MIB = 2**20
LEJEPA = [(2, 64, 64, 1024), (4, 64, 64, 1024), (4, 128, 64, 1024), (4, 64, 64, 256), (8, 32, 64, 512)]
PAIRS = [(64, 1024), (64, 2048), (256, 2048), (128, 4096)]


def _peak_kib() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


def _embeddings(rows: int, dim: int) -> torch.Tensor:
    """(rows, dim) from a linear layer, so the loss's backward reaches a parameter."""
    x, w = torch.randn(rows, dim), torch.randn(dim, dim, requires_grad=True)
    (x @ w).sum().backward()  # the allocator's first large blocks, before the baseline
    return x @ w


def _lejepa(views: int, n: int, dim: int, slices: int) -> float:
    z = _embeddings(views * n, dim).view(views, n, dim)
    before = _peak_kib()
    lejepa_loss(z[:2], z[2:] if views > 2 else None, step=0, num_slices=slices).backward()
    return (_peak_kib() - before) / 1024, views * n * slices * 17 * 4 / MIB


def _pair(loss, n: int, dim: int) -> float:
    z = _embeddings(2 * n, dim)
    before = _peak_kib()
    loss(*z.chunk(2)).backward()
    return (_peak_kib() - before) / 1024, dim * dim * 4 / MIB


def in_fork(fn, *args):
    """``fn(*args)`` in a fork: (peak MiB added, unit MiB)."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        gc.collect()
        torch.set_num_threads(1)
        os.write(write, repr(fn(*args)).encode())
        os._exit(0)
    os.close(write)
    with os.fdopen(read) as pipe:
        result = eval(pipe.read())
    os.waitpid(pid, 0)
    return result


def main() -> None:
    print("| loss | shape | peak added, MiB | largest tensor, MiB | multiple |")
    print("|---|---|---|---|---|")
    cases = [("LeJEPA", f"V={v} N={n} D={d} M={m}", _lejepa, (v, n, d, m)) for v, n, d, m in LEJEPA]
    for name, loss in (("Barlow Twins", barlow_twins_loss), ("VICReg", vicreg_loss)):
        cases += [(name, f"N={n} D={d}", _pair, (loss, n, d)) for n, d in PAIRS]
    for name, shape, fn, args in cases:
        added, unit = in_fork(fn, *args)
        print(f"| {name} | {shape} | {added:.1f} | {unit:.1f} | {added / unit:.2f} |", flush=True)


if __name__ == "__main__":
    main()
