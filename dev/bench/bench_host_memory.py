"""Prints step time and peak RSS per glibc mmap threshold (MACHINE.CPU_MMAP_THRESHOLD_MIB).

What fixing glibc's mmap threshold (``MACHINE.CPU_MMAP_THRESHOLD_MIB``) costs in speed and
saves in memory, for plain single-process training steps on CPU.

    python dev/bench/bench_host_memory.py [--thresholds 0 1 4] [--rounds 3] [--steps 12]

Each (case, threshold) runs in a fresh process; the rounds alternate the thresholds so that
machine noise hits all alike. Prints the median step time as a ratio to glibc's default
(threshold 0) and each process's peak RSS. Cases: the quick start's model and batch
(``config=regnet_fsdp``: 2 x 64 crops of 28 px) and torchvision's RegNetY-3.2GF (8 images of
128 px). The sharded engine's memory side is ``dev/bench/bench_big_model.py``'s.
"""

import argparse
import json
import statistics
import subprocess
import sys
import time

CASES = ("quick_start", "regnet_y_3_2gf")


def one_run(case: str, threshold: float, steps: int) -> dict:
    """In this process: fix the threshold, train ``steps`` steps, return times and peak RSS."""
    from vistrain.runtime.host_memory import set_mmap_threshold

    set_mmap_threshold(threshold)
    import torch
    import torchvision

    from vistrain.fsdp.memory import peak_rss_mib
    from vistrain.methods import build_model, load_config

    torch.manual_seed(0)
    torch.set_num_threads(1)
    if case == "quick_start":
        model = build_model(load_config(["config=regnet_fsdp"]).MODEL)
        batch = [torch.randn(64, 3, 28, 28) for _ in range(2)]
    else:
        model = torchvision.models.regnet_y_3_2gf()
        batch = torch.randn(8, 3, 128, 128)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        model(batch).float().pow(2).mean().backward()
        optimizer.step()
        times.append(time.perf_counter() - start)
    return {"step_s": statistics.median(times[2:]), "peak_rss_mib": peak_rss_mib()}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--thresholds", type=float, nargs="+", default=[0, 1, 4])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--one", nargs=2, metavar=("CASE", "THRESHOLD"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        print(json.dumps(one_run(args.one[0], float(args.one[1]), args.steps)))
        return
    results = {(c, t): [] for c in CASES for t in args.thresholds}
    for _ in range(args.rounds):
        for case in CASES:
            for t in args.thresholds:
                cmd = [sys.executable, __file__, "--one", case, str(t), "--steps", str(args.steps)]
                out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
                results[(case, t)].append(json.loads(out.strip().splitlines()[-1]))
    for case in CASES:
        base = statistics.median(r["step_s"] for r in results[(case, args.thresholds[0])])
        for t in args.thresholds:
            runs = results[(case, t)]
            step = statistics.median(r["step_s"] for r in runs)
            rss = max(r["peak_rss_mib"] for r in runs)
            label = "glibc default" if t == 0 else f"{t:g} MiB"
            print(
                f"{case:<15} threshold {label:<13} step {step * 1000:7.1f} ms  "
                f"({step / base:.2f}x default)  peak RSS {rss:.0f} MiB"
            )


if __name__ == "__main__":
    main()
