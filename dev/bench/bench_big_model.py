"""Prints each engine's logged peak mem per rank beside the planner's, for a model that barely fits.

Train a model that does not fit comfortably on this machine, with our engine and with PyTorch's
``fully_shard``, and print for each run the peak ``mem`` per rank it logs next to what
``tools/plan_memory.py`` predicts, and what the machine as a whole used.

    python dev/bench/bench_big_model.py [--model regnet_y_128gf] [--ranks 4] [--backends builtin torch]
        [--step-in-backward] [--cpu-mmap-threshold-mib 0] [--extra config.X=Y ...]

RegNetY-128GF (637M parameters, 2.37 GiB fp32), SimCLR head [7392, 512, 128], batch 2 per rank,
28 px crops, 16 images (2 iterations of 4 ranks), LARS: the setting of issue 10; SEER's
RegNetY-256GF (1.27B) takes head [10444, 512, 128]. Each backend is a separate
``tools/run_distributed.py`` job, one after the other (they never share the machine's memory).

Per-rank RSS counts the shared library pages of every rank again, so the machine's use is
reported twice more: the largest sum of the ranks' PSS (``/proc/PID/smaps_rollup``) and the
largest drop of ``MemAvailable``, both sampled every 0.2 s. A run whose plan does not fit in
``MemAvailable`` (with a 1.5 GiB margin) is not started: it would take the machine down. A
benchmark, not a test; the checkpoint written at the end goes to a temporary folder.
"""

import argparse
import re
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from vistrain.planner.auto_tune import available_memory_mib

REPO = Path(__file__).resolve().parents[2]
HEAD_INPUT = {
    "regnet_y_128gf": 7392,
    "regnet_y_256gf": 10444,
    "regnet_y_32gf": 3712,
    "regnet_y_16gf": 3024,
    "regnet_y_8gf": 2016,
    "regnet_y_3_2gf": 1512,
    "regnet_y_400mf": 440,
}
MEM = re.compile(r"mem (\d+) MiB")
MARGIN_MIB = 1536


def config_args(backend: str, args) -> list:
    return [
        "config=regnet_fsdp",
        f"config.MODEL.TRUNK.REGNET.NAME={args.model}",
        f"config.MODEL.HEAD.DIMS=[{HEAD_INPUT[args.model]},512,128]",
        "config.MODEL.FSDP_CONFIG.AUTO_SETUP_FSDP=True",
        "config.MODEL.FSDP_CONFIG.AUTO_TUNE=False",  # the knobs as given: ours vs fully_shard alike
        f"config.MODEL.FSDP_CONFIG.BACKEND={backend}",
        f"config.DISTRIBUTED.NUM_PROC_PER_NODE={args.ranks}",
        "config.DATA.TRAIN.BATCHSIZE_PER_REPLICA=2",
        f"config.DATA.TRAIN.DATA_LIMIT={args.images}",
        "config.OPTIMIZER.num_epochs=1",
        "config.LOG_FREQUENCY=1",
        f"config.MACHINE.CPU_MMAP_THRESHOLD_MIB={args.cpu_mmap_threshold_mib}",
        f"config.OPTIMIZER.step_in_backward={args.step_in_backward and backend == 'builtin'}",
        *args.extra,
    ]


def planned_mib(cfg_args: list, backend: str) -> float:
    """The planner's peak per rank; for fully_shard at least the whole fp32 model it builds on
    every rank before sharding (the planner models our engine's unit-by-unit build)."""
    from vistrain.methods import load_config
    from vistrain.planner.memory import plan
    from vistrain.planner.shape import run_shape

    cfg = load_config(cfg_args)
    if cfg.MODEL.FSDP_CONFIG.AUTO_TUNE:  # plan what the run will choose
        from vistrain.planner.auto_tune import tune_job

        cfg = tune_job(cfg, cfg_args).cfg
    result = plan(run_shape(cfg), "cpu")
    if backend == "torch":
        return max(result.peak, whole_model_bytes(cfg_args) + result.runtime_overhead) / 2**20
    return result.peak / 2**20


def _descendants(pid: int) -> list:
    out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True, text=True)
    children = [int(p) for p in out.stdout.split()]
    return children + [d for c in children for d in _descendants(c)]


def _pss_mib(pid: int) -> float:
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                if line.startswith("Pss:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


class MachineWatch(threading.Thread):
    """Samples the sum of PSS over a process tree and MemAvailable until stopped."""

    def __init__(self, root_pid: int):
        super().__init__(daemon=True)
        self.root_pid, self.stop = root_pid, threading.Event()
        self.start_available = available_memory_mib()
        self.max_pss, self.min_available = 0.0, self.start_available

    def run(self):
        while not self.stop.wait(0.2):
            pids = [self.root_pid, *_descendants(self.root_pid)]
            self.max_pss = max(self.max_pss, sum(_pss_mib(p) for p in pids))
            self.min_available = min(self.min_available, available_memory_mib())


def run_job(cfg_args: list) -> dict:
    """Run ``tools/run_distributed.py`` with ``cfg_args`` in a temporary run folder: the peak
    ``mem`` it logs (MiB, the maximum over ranks), the machine's PSS sum and MemAvailable drop."""
    with tempfile.TemporaryDirectory() as run_dir:
        return _run([*cfg_args, f"config.CHECKPOINT.DIR={run_dir}"])


def _run(cfg_args: list) -> dict:
    cmd = [sys.executable, str(REPO / "tools" / "run_distributed.py"), *cfg_args]
    print(" ".join(cmd[1:]), flush=True)
    start = time.time()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    watch = MachineWatch(proc.pid)
    watch.start()
    output = proc.communicate()[0]
    watch.stop.set()
    watch.join()
    peaks = [int(m) for m in MEM.findall(output)]
    if proc.returncode != 0 or not peaks:
        tail = "\n".join(output.splitlines()[-15:])
        raise SystemExit(f"run failed (exit {proc.returncode}):\n{tail}")
    return {
        "peak": max(peaks),
        "pss_sum": watch.max_pss,
        "available_drop": watch.start_available - watch.min_available,
        "wall_s": time.time() - start,
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="regnet_y_128gf", choices=sorted(HEAD_INPUT))
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--images", type=int, default=16)
    parser.add_argument("--backends", nargs="+", default=["builtin", "torch"])
    parser.add_argument("--step-in-backward", action="store_true", help="OPTIMIZER.step_in_backward (ours)")
    parser.add_argument("--cpu-mmap-threshold-mib", type=float, default=0.0, help="of both runs")
    parser.add_argument("--extra", nargs="*", default=[], help="more config.X=Y overrides")
    args = parser.parse_args()
    results = {}
    for backend in args.backends:
        plan = planned_mib(config_args(backend, args), backend)
        available = available_memory_mib()
        if plan * args.ranks + MARGIN_MIB > available:
            print(
                f"{backend:<8} not started: planned {plan:.0f} MiB x {args.ranks} ranks does not fit "
                f"in {available:.0f} MiB available (margin {MARGIN_MIB} MiB)",
                flush=True,
            )
            continue
        r = results[backend] = {**run_job(config_args(backend, args)), "plan": plan}
        print(
            f"{backend:<8} peak mem per rank: {r['peak']} MiB (planned {plan:.0f}, "
            f"{r['peak'] / plan - 1:+.1%}); machine: PSS sum {r['pss_sum']:.0f} MiB, "
            f"MemAvailable drop {r['available_drop']:.0f} MiB; {r['wall_s']:.0f} s",
            flush=True,
        )
    if {"builtin", "torch"} <= set(results):
        print(f"builtin / fully_shard: {results['builtin']['peak'] / results['torch']['peak']:.2f}x")


def whole_model_bytes(cfg_args: list) -> float:
    """fp32 bytes of the whole model (trunk and head)."""
    import torch

    from vistrain.methods import build_model, load_config

    with torch.device("meta"):
        model = build_model(load_config(cfg_args).MODEL)
    return sum(p.numel() for p in model.parameters()) * 4


if __name__ == "__main__":
    main()
