"""Prints peak RSS of every path that reads or writes whole-model weights, old and current code.

Peak RSS of every path that reads or writes whole-model weights, old code and new side by side.

    python dev/bench/bench_weights_io.py [--model regnet_y_16gf] [--before 59078ef] [--ranks 2]

Writes a checkpoint of an SSL RegNetY (SimCLR head, SGD momentum, one step) saved by ``--ranks``
gloo ranks and a consolidated ``.pt`` of the same model into a temporary folder (with the current
code), then measures, each in a fresh process, with the code of ``--before`` (a ``git archive``
of that commit) and with the current tree:

* ``WEIGHTS_INIT`` from the ``.pt`` file and from the checkpoint folder under AUTO_SETUP_FSDP
  (``build_for_run`` on the meta device, ``load_pretrained``, ``shard_model``) on ``--ranks``;
* resume (``load_sharded_checkpoint`` into the sharded model and its SGD optimizer) on ``--ranks``;
* ``tools/convert_checkpoint.py --to-consolidated`` and ``--to-torchvision``.

For each: the peak RSS of the process (the busiest rank; ``VmHWM``, file-backed pages included)
and its growth over the RSS just before the step (ranks: after building the meta model, or the
sharded model and optimizer; the tool: a process that only imports ``vistrain.checkpoint``).
A benchmark, not a test. Needs about 4x the model size of free memory at 2 ranks.
"""

import argparse
import json
import os
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
HEAD_INPUT = {"regnet_y_3_2gf": 1512, "regnet_y_8gf": 2016, "regnet_y_16gf": 3024, "regnet_y_32gf": 3712}
STEPS = ("init_file", "init_folder", "resume", "to_consolidated", "to_torchvision")


def _status_mib(key: str) -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) / 1024
    raise KeyError(key)


def _cfg(model: str, weights: str = ""):
    from vistrain.methods import load_config

    return load_config(
        [
            "config=regnet_fsdp",
            f"config.MODEL.TRUNK.REGNET.NAME={model}",
            f"config.MODEL.HEAD.DIMS=[{HEAD_INPUT[model]},512,128]",
            "config.MODEL.FSDP_CONFIG.AUTO_SETUP_FSDP=True",
            f"config.MODEL.WEIGHTS_INIT.PARAMS_FILE={weights}",
        ]
    )


def _sharded(cfg, weights: bool):
    """(sharded model, RSS before WEIGHTS_INIT / sharding)."""
    import functools

    import torch

    from vistrain.checkpoint import load_pretrained
    from vistrain.methods import build_model
    from vistrain.optim import param_group_key
    from vistrain.runtime.sharding import build_for_run, shard_model

    torch.manual_seed(cfg.SEED_VALUE)
    model = build_for_run(build_model, cfg.MODEL)
    before = _status_mib("VmRSS")
    if weights:
        load_pretrained(model, cfg.MODEL.WEIGHTS_INIT)
    group_key = functools.partial(param_group_key, opt_cfg=cfg.OPTIMIZER)
    return shard_model(model, cfg.MODEL, group_key), before


def _setup_worker(rank, world, model_name, run_dir):
    import torch

    from vistrain.checkpoint import save_sharded_checkpoint

    model, _ = _sharded(_cfg(model_name), weights=False)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    out = model(torch.randn(2, 3, 32, 32))
    out = out[0] if isinstance(out, (list, tuple)) else out
    out.float().pow(2).mean().backward()
    optimizer.step()
    return save_sharded_checkpoint(run_dir, 1, model, optimizer, {}, {}, keep_last=1)


def _init_worker(rank, world, model_name, weights):
    _, before = _sharded(_cfg(model_name, weights), weights=True)
    return before, _status_mib("VmHWM")


def _resume_worker(rank, world, model_name, checkpoint):
    import torch

    from vistrain.checkpoint import load_sharded_checkpoint

    model, _ = _sharded(_cfg(model_name), weights=False)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    before = _status_mib("VmRSS")
    load_sharded_checkpoint(checkpoint, model, optimizer)
    return before, _status_mib("VmHWM")


def _measure_ranks(step: str, model: str, ranks: int, work: Path) -> dict:
    """In this (fresh) process: run ``step`` on ``ranks`` gloo ranks; the busiest rank's numbers."""
    from vistrain.distributed.testing import run_on_ranks

    checkpoint = str(work / "run" / "checkpoint_1")
    if step == "resume":
        results = run_on_ranks(_resume_worker, ranks, model, checkpoint)
    else:
        weights = str(work / "model.pt") if step == "init_file" else checkpoint
        results = run_on_ranks(_init_worker, ranks, model, weights)
    before, peak = max(results, key=lambda r: r[1])
    return {"peak": peak, "growth": peak - before}


def _child_peak_mib(cmd, env) -> float:
    """Peak RSS (MiB) of the child process running ``cmd``."""
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    _, status, usage = os.wait4(proc.pid, 0)
    output = proc.stdout.read().decode()
    proc.stdout.close()
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"{' '.join(map(str, cmd))} failed:\n{output}")
    return usage.ru_maxrss / 1024


def _measure_tool(step: str, code: Path, work: Path) -> dict:
    env = {**os.environ, "PYTHONPATH": str(code)}
    base = _child_peak_mib([sys.executable, "-c", "import vistrain.checkpoint"], env)
    flag = "--to-consolidated" if step == "to_consolidated" else "--to-torchvision"
    out = work / f"{step}.{code.name}.pt"
    tool = code / "tools" / "convert_checkpoint.py"
    peak = _child_peak_mib([sys.executable, str(tool), str(work / "run"), flag, str(out)], env)
    return {"peak": peak, "growth": peak - base}


def _run_measurement(step: str, code: Path, args, work: Path) -> dict:
    if step.startswith("to_"):
        return _measure_tool(step, code, work)
    cmd = [sys.executable, str(Path(__file__).resolve()), "--measure", step, "--model", args.model]
    cmd += ["--ranks", str(args.ranks), "--work", str(work)]
    env = {**os.environ, "PYTHONPATH": str(code)}
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"{step} with {code} failed:\n{proc.stdout[-3000:]}{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _export(rev: str, into: Path) -> Path:
    """The tree of commit ``rev`` under ``into/before``."""
    target = into / "before"
    target.mkdir()
    archive = into / "before.tar"
    subprocess.run(["git", "-C", str(REPO), "archive", "-o", str(archive), rev], check=True)
    with tarfile.open(archive) as tar:
        tar.extractall(target, filter="data")
    return target


def _setup(args, work: Path) -> float:
    """Checkpoint folder and consolidated file of the model; returns the model's fp32 MiB."""
    import torch

    from vistrain.distributed.testing import run_on_ranks
    from vistrain.methods import build_model

    run_on_ranks(_setup_worker, args.ranks, args.model, str(work / "run"))
    torch.manual_seed(0)
    state = build_model(_cfg(args.model).MODEL).state_dict()
    torch.save(state, work / "model.pt")
    return sum(v.numel() * v.element_size() for v in state.values()) / 2**20


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="regnet_y_16gf", choices=sorted(HEAD_INPUT))
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--before", default="59078ef", help="commit of the old code")
    parser.add_argument("--steps", nargs="+", default=list(STEPS), choices=STEPS)
    parser.add_argument("--measure", choices=STEPS, help=argparse.SUPPRESS)  # one child measurement
    parser.add_argument("--work", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.measure:
        print(json.dumps(_measure_ranks(args.measure, args.model, args.ranks, Path(args.work))))
        return
    sys.path.insert(0, str(REPO))
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        size = _setup(args, work)
        print(f"{args.model} + SimCLR head: {size:.0f} MiB of fp32 weights and buffers, {args.ranks} ranks")
        codes = {"before": _export(args.before, work), "after": REPO}
        print(f"{'step':<16} {'before: peak / growth':>24} {'after: peak / growth':>24}  (MiB)")
        for step in args.steps:
            row = {name: _run_measurement(step, code, args, work) for name, code in codes.items()}
            cells = [f"{row[n]['peak']:>10.0f} / {row[n]['growth']:>8.0f}" for n in codes]
            print(f"{step:<16} {cells[0]:>24} {cells[1]:>24}", flush=True)


if __name__ == "__main__":
    main()
