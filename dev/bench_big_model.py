"""Train a model that does not fit comfortably on this machine, with our engine and with PyTorch's
``fully_shard``, and print the peak ``mem`` per rank of each (CPU: peak RSS of the busiest rank).

    python dev/bench_big_model.py [--model regnet_y_128gf] [--ranks 4] [--backends builtin torch]

RegNetY-128GF (637M parameters, 2.37 GiB fp32), SimCLR head [7392, 512, 128], batch 2 per rank,
28 px crops, 16 images (2 iterations of 4 ranks), LARS: the setting of issue 10. Each backend is
a separate ``tools/run_distributed.py`` job, one after the other (they never share the machine's
memory). Needs most of a 24 GB machine at 4 ranks: check ``free -g`` first. A benchmark, not a
test; the sharded checkpoint written at the end goes to a temporary folder that is deleted.
"""

import argparse
import re
import subprocess
import sys
import tempfile
from pathlib import Path

HEAD_INPUT = {
    "regnet_y_128gf": 7392,
    "regnet_y_256gf": 10444,
    "regnet_y_32gf": 3712,
    "regnet_y_16gf": 3024,
    "regnet_y_400mf": 440,
}
MEM = re.compile(r"mem (\d+) MiB")


def run(backend: str, args, run_dir: Path) -> int:
    """Peak ``mem`` (MiB, the maximum over ranks that every log line reports) of one job."""
    cmd = [
        sys.executable,
        str(Path(__file__).resolve().parents[1] / "tools" / "run_distributed.py"),
        "config=regnet_fsdp",
        f"config.MODEL.TRUNK.REGNET.NAME={args.model}",
        f"config.MODEL.HEAD.DIMS=[{HEAD_INPUT[args.model]},512,128]",
        "config.MODEL.FSDP_CONFIG.AUTO_SETUP_FSDP=True",
        f"config.MODEL.FSDP_CONFIG.BACKEND={backend}",
        f"config.DISTRIBUTED.NUM_PROC_PER_NODE={args.ranks}",
        "config.DATA.TRAIN.BATCHSIZE_PER_REPLICA=2",
        f"config.DATA.TRAIN.DATA_LIMIT={args.images}",
        "config.OPTIMIZER.num_epochs=1",
        "config.LOG_FREQUENCY=1",
        f"config.CHECKPOINT.DIR={run_dir}",
        f"config.MACHINE.CPU_MMAP_THRESHOLD_MIB={args.cpu_mmap_threshold_mib}",
    ]
    print(" ".join(cmd[1:]), flush=True)
    proc = subprocess.run(cmd, capture_output=True, text=True)
    peaks = [int(m) for m in MEM.findall(proc.stdout + proc.stderr)]
    if proc.returncode != 0 or not peaks:
        tail = "\n".join((proc.stdout + proc.stderr).splitlines()[-15:])
        raise SystemExit(f"{backend}: run failed (exit {proc.returncode}):\n{tail}")
    return max(peaks)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="regnet_y_128gf", choices=sorted(HEAD_INPUT))
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--images", type=int, default=16)
    parser.add_argument("--backends", nargs="+", default=["builtin", "torch"])
    parser.add_argument(
        "--cpu-mmap-threshold-mib",
        type=float,
        default=0.0,
        help="MACHINE.CPU_MMAP_THRESHOLD_MIB of both runs",
    )
    args = parser.parse_args()
    peaks = {}
    for backend in args.backends:
        with tempfile.TemporaryDirectory() as run_dir:
            peaks[backend] = run(backend, args, Path(run_dir))
        print(f"{backend:<8} peak mem per rank: {peaks[backend]} MiB", flush=True)
    if {"builtin", "torch"} <= set(peaks):
        print(f"builtin / fully_shard: {peaks['builtin'] / peaks['torch']:.2f}x")


if __name__ == "__main__":
    main()
