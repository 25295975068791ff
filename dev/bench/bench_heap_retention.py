"""Prints planned vs logged peak mem per rank at glibc's default and with a fixed mmap threshold.

What glibc keeps beyond the planner's model terms: each 2-rank run of ``tests/test_memory_plan.py``
at glibc's default and with its mmap threshold fixed (``MACHINE.CPU_MMAP_THRESHOLD_MIB=1``, where
freed blocks go back at once), planned next to logged ``mem`` (peak RSS of the busiest rank).

    python dev/bench/bench_heap_retention.py [--cases resnet18 vit_tiny ...] [--arenas]

The logged difference between the two settings is what the heaps retain at the peak. ``--arenas``
also prints, per rank, glibc's arenas at that rank's RSS peak (``malloc_info``, dumped by a
sampling thread at every new peak): the main arena (the training thread) and each thread's own
(gloo's workers, the loader), each with its size and how much of it is free. One run at a time,
2 ranks x 1 thread; a benchmark, not a test.
"""

import argparse
import ctypes
import importlib.util
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
THRESHOLDS = {"glibc default": 0, "threshold fixed": 1}


def test_runs():
    spec = importlib.util.spec_from_file_location("test_memory_plan", ROOT / "tests" / "test_memory_plan.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.RUNS


def _rss_anon_mib() -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) / 1024 for line in f if line.startswith("RssAnon:"))


def _watch_peaks(path: str, stop: threading.Event) -> None:
    """Dump ``malloc_info`` to ``path`` at every new RssAnon peak (1 MiB steps) until ``stop``."""
    libc = ctypes.CDLL("libc.so.6")
    libc.fopen.restype = ctypes.c_void_p
    libc.fopen.argtypes = [ctypes.c_char_p, ctypes.c_char_p]
    libc.fclose.argtypes = [ctypes.c_void_p]
    libc.malloc_info.argtypes = [ctypes.c_int, ctypes.c_void_p]
    best = 0.0
    while not stop.is_set():
        anon = _rss_anon_mib()
        if anon > best + 1:
            best = anon
            f = libc.fopen(path.encode(), b"w")
            libc.malloc_info(0, f)
            libc.fclose(f)
        time.sleep(0.001)


def rank_probe(argv, out_dir: str) -> int:
    """Run the job in this process (the launcher forks the ranks); each rank watches its peaks."""
    import vistrain.distributed.spawn as spawn
    from vistrain.cli import main

    # the rank body the launcher forks: wrapped here only to watch it (a dev probe, not the engine)
    run_rank = spawn._run_spawned_rank  # noqa: SLF001

    def watched(local_rank, *args):
        stop = threading.Event()
        path = os.path.join(out_dir, f"rank{local_rank}.xml")
        threading.Thread(target=_watch_peaks, args=(path, stop), daemon=True).start()
        try:
            run_rank(local_rank, *args)
        finally:
            stop.set()

    spawn._run_spawned_rank = watched  # noqa: SLF001
    return main(argv)


def arenas(xml: str):
    """[(arena number, MiB mapped, MiB free)] from ``malloc_info`` output (arena 0: the main one)."""
    out = []
    for nr, body in re.findall(r'<heap nr="(\d+)">(.*?)</heap>', xml, re.S):
        current = int(re.search(r'<system type="current" size="(\d+)"', body).group(1))
        free = int(re.search(r'<total type="rest" count="\d+" size="(\d+)"', body).group(1))
        out.append((int(nr), current / 2**20, free / 2**20))
    return out


def run_case(name: str, args, show_arenas: bool) -> None:
    from vistrain.methods import load_config
    from vistrain.planner.memory import plan
    from vistrain.planner.shape import MIB, run_shape

    for label, threshold in THRESHOLDS.items():
        with tempfile.TemporaryDirectory() as tmp:
            full = [*args, "config.DISTRIBUTED.NUM_PROC_PER_NODE=2", "config.OPTIMIZER.num_epochs=1",
                    "config.LOG_FREQUENCY=1", f"config.CHECKPOINT.DIR={tmp}/run",
                    f"config.DATA.CACHE_DIR={tmp}/cache", f"config.MACHINE.CPU_MMAP_THRESHOLD_MIB={threshold}"]  # fmt: skip
            planned = plan(run_shape(load_config(full))).peak / MIB
            cmd = [sys.executable, __file__, "--rank-probe", tmp, "--", *full]
            proc = subprocess.run(
                cmd, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"}
            )
            logged = [int(m) for m in re.findall(r"mem (\d+) MiB", proc.stdout + proc.stderr)]
            if proc.returncode != 0 or not logged:
                print(f"{name} ({label}): failed\n{proc.stderr[-2000:]}")
                continue
            peak = max(logged)
            print(
                f"{name} ({label}): planned {planned:.0f} MiB, logged {peak} MiB ({(planned - peak) / peak:+.1%})"
            )
            for xml in sorted(Path(tmp).glob("rank*.xml")) if show_arenas else []:
                shown = [
                    f"{nr}: {size:.1f} ({free:.1f} free)"
                    for nr, size, free in arenas(xml.read_text())
                    if size >= 1
                ]
                print(f"  {xml.stem} arenas at its peak, MiB: " + ", ".join(shown))


def main() -> None:
    if len(sys.argv) > 2 and sys.argv[1] == "--rank-probe":
        sys.path.insert(0, str(ROOT))
        sys.exit(rank_probe(sys.argv[4:], sys.argv[2]))
    runs = test_runs()
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", nargs="+", default=sorted(runs), choices=sorted(runs))
    parser.add_argument("--arenas", action="store_true", help="glibc's arenas at each rank's peak")
    options = parser.parse_args()
    for name in options.cases:
        run_case(name, runs[name], options.arenas)


if __name__ == "__main__":
    main()
