"""Prints the momentum teacher's EMA time as a share of a training step: flat shards vs per tensor.

The momentum teacher's EMA as a share of a training step, foreach over flat shards vs per tensor.

    python dev/bench/bench_ema.py [--config pretrain/dino_regnet_demo] [--world 2] [--steps 10] [config.A.B=v ...]

On ``--world`` gloo ranks (CPU; threads split as tools/run_distributed.py does) it builds the
recipe's student and teacher exactly as a run does (``runtime.parallel`` / ``runtime.teacher``:
sharded under AUTO_SETUP_FSDP, else DDP and a plain teacher), then times, per step on random crops of
the recipe's sizes: a whole training step (teacher forward, student forward, loss, backward,
optimizer step, EMA) and, separately, the EMA alone in three forms over the same tensors:

* ``foreach``: two foreach kernels over this rank's flat shards (``foreach_ema_``, what a run's
  ``MomentumTeacher.update`` does: the shards are paired and checked once);
* ``ema_update_``: the same, pairing and checking the layouts at every call;
* ``per tensor (shards)``: ``t.mul_(m).add_(s, alpha=1 - m)`` shard by shard;
* ``per tensor (params)``: the same, parameter by parameter of the unsharded teacher (what a loop
  over original parameters costs: one pair of kernels per parameter).

Prints medians (ms) and each EMA's share of the step. Numbers in docs/benchmarks.md come from here.
"""

import argparse
import os
import statistics
import time

import torch
import torch.distributed as dist

from vistrain.distributed.testing import run_on_ranks
from vistrain.fsdp import ema_update_, foreach_ema_, paired_tensors
from vistrain.losses import MomentumTeacher
from vistrain.methods import build_method, build_model, load_config
from vistrain.optim import build_optimizer
from vistrain.planner.shape import crops_of, meta_crops
from vistrain.runtime.parallel import parallelize
from vistrain.runtime.sharding import build_for_run
from vistrain.runtime.teacher import build_teacher


def _per_tensor(targets, sources, m):
    with torch.no_grad():
        for t, s in zip(targets, sources):
            t.mul_(m).add_(s, alpha=1 - m)


def _median_ms(fn, repeats):
    times = []
    for _ in range(repeats):
        dist.barrier()
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1000 * statistics.median(times)


def _worker(rank, world, argv, steps, threads):
    torch.set_num_threads(threads)
    cfg = load_config(argv)
    torch.manual_seed(0)
    device = torch.device("cpu")
    model = parallelize(build_for_run(build_model, cfg.MODEL), cfg.MODEL, device)
    optimizer = build_optimizer(cfg.OPTIMIZER, model)
    criterion = build_method(cfg)
    teacher = MomentumTeacher(build_teacher(build_model, cfg.MODEL, device, model), 0.996, steps)
    batch = cfg.DATA.TRAIN.BATCHSIZE_PER_REPLICA
    crops = [torch.randn(c.shape) for c in meta_crops(crops_of(cfg.DATA.TRAIN), batch)]

    def step(iteration=0):
        student = criterion.student_crops(crops)
        masking = criterion.masking(student)
        targets = teacher(criterion.teacher_crops(crops), **criterion.teacher_masking())
        loss = criterion(model(student, **masking), len(crops), targets)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        teacher.update(model, iteration)

    step()  # warm-up: lazy init, first gathers
    step_ms = _median_ms(step, steps)
    targets, sources = paired_tensors(teacher.model, model)
    foreach_ms = _median_ms(lambda: foreach_ema_(targets, sources, 0.996), steps * 5)
    checked_ms = _median_ms(lambda: ema_update_(teacher.model, model, 0.996), steps * 5)
    shards_ms = _median_ms(lambda: _per_tensor(targets, sources, 0.996), steps * 5)
    plain_t, plain_s = build_model(cfg.MODEL), build_model(cfg.MODEL)
    params = (list(plain_t.parameters()), list(plain_s.parameters()))
    params_ms = _median_ms(lambda: _per_tensor(*params, 0.996), steps * 5)
    local = sum(t.numel() for t in targets)
    return dict(step=step_ms, foreach=foreach_ms, checked=checked_ms, shards=shards_ms, params=params_ms, tensors=len(targets),
                params_count=len(params[0]), local_elements=local)  # fmt: skip


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="pretrain/dino_regnet_demo")
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--steps", type=int, default=10)
    args, overrides = parser.parse_known_args()
    argv = [f"config={args.config}", "config.MODEL.FSDP_CONFIG.AUTO_TUNE=False", *overrides]
    threads = max(1, (os.cpu_count() or 1) // args.world)
    out = run_on_ranks(_worker, args.world, argv, args.steps, threads)[0]
    print(f"{args.config} {' '.join(overrides)} on {args.world} gloo ranks, {threads} thread(s) each")
    print(f"  step (teacher fwd + student fwd/bwd + optimizer + EMA): {out['step']:.1f} ms")
    print(f"  local teacher tensors: {out['tensors']} flat shards / {out['params_count']} parameters, "
          f"{out['local_elements'] / 1e6:.2f} M elements")  # fmt: skip
    for key, name in (("foreach", "foreach (shards)"), ("checked", "ema_update_ (checks)"), ("shards", "per tensor (shards)"),
                      ("params", "per tensor (params)")):  # fmt: skip
        print(f"  EMA {name:24s} {out[key]:8.3f} ms  {100 * out[key] / out['step']:5.2f}% of the step")


if __name__ == "__main__":
    main()
