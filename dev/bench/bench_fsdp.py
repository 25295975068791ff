"""Prints step time, memory and planner estimate of every engine knob setting, DDP and fully_shard.

Every exact knob setting of the sharded engine next to DDP and PyTorch's fully_shard, in the same processes.

    python dev/bench/bench_fsdp.py [--world 2] [--steps 12] [--batch 8] [--size 64] [--model regnet_y_400mf]
        (--model: a torchvision name, or timm:NAME / torchvision:NAME for a library trunk)
                             [--shard-group-size K] [--trim-after-mib N]

Each rank gets the threads ``tools/run_distributed.py`` would give it (cores / ranks), builds every
engine from the same seed and, step after step, runs one training step of each in turn (the order
rotated every step) on the same data, so machine noise hits all alike. Ours runs with every wrap
granularity (block, stage, model) with reshard_after_forward on (ZeRO-3) and off (ZeRO-2), each
also with activation checkpointing per block and per stage, with prefetch depth 0 and 2, and
with the optimizer step inside backward; fully_shard per block with ZeRO-3 and ZeRO-2.

Per setting it prints the median step time as a ratio to DDP's, and its communication floor: the
same all-gathers and reduce-scatters (DDP: all-reduces of its buckets) timed alone in the same
processes, so the distance from the floor shows. Then the factors ``vistrain/planner/knobs.py``
uses, as measured here, and how often the planner's speed order (``speed_cost``) agrees with the
measured one. Also persistent storage bytes per rank (``untyped_storage().nbytes()``, each storage
once) next to DDP's / N. CPU: gloo; CUDA: NCCL. ``--shard-group-size K``: hybrid sharding (ours
with shard groups of K ranks, fully_shard on a 2-D mesh).
"""

import argparse
import itertools
import os
import statistics
import time

import torch
import torch.distributed as dist
import torchvision
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from vistrain.distributed.testing import run_on_ranks
from vistrain.fsdp import RootOptions, auto_wrap, hybrid_groups, model_state
from vistrain.fsdp.collectives import gather_into, reduce_scatter_into
from vistrain.fsdp.memory import held_tensors, storage_bytes
from vistrain.models.units import GRANULARITIES, unit_classes
from vistrain.planner.knobs import speed_cost
from vistrain.runtime.sharding import apply_activation_checkpointing, torch_fully_shard, wrap_policy

DDP_BUCKET_MIB, DDP_FIRST_BUCKET_MIB = 25, 1  # DDP's defaults


class LibraryClassifier(nn.Module):
    """A library trunk (``timm:NAME``, ``torchvision:NAME``) and a linear classifier on its pooled
    feature: the blocks the family found from the structure are the units."""

    def __init__(self, trunk):
        super().__init__()
        self.trunk = trunk
        self.fc = nn.Linear(trunk.feature_dims["avgpool"], 10)

    def forward(self, x):
        return self.fc(self.trunk(x)["avgpool"])


def build(name):
    """torchvision's ``name`` (10 classes), or a library trunk: ``timm:vit_small_patch16_224``."""
    torch.manual_seed(0)
    if ":" not in name:
        return getattr(torchvision.models, name)(num_classes=10)
    from vistrain.config import load_config
    from vistrain.models.trunks import build_trunk

    library, model = name.split(":", 1)
    key = "TIMM" if library == "timm" else "TORCHVISION"
    trunk_cfg = load_config(
        [f"config.MODEL.TRUNK.NAME={library}", f"config.MODEL.TRUNK.{key}.NAME={model}"]
    ).MODEL.TRUNK
    return LibraryClassifier(build_trunk(trunk_cfg))


def settings():
    """(row name, knobs) of every sharded setting measured; knobs as vistrain.planner.knobs names them."""
    out = []
    for granularity, reshard in itertools.product(GRANULARITIES, (True, False)):
        base = dict(wrap_granularity=granularity, reshard_after_forward=reshard)
        name = f"{granularity} {'zero3' if reshard else 'zero2'}"
        out.append((name, base))
        for ckpt in ("block", "stage"):
            out.append(
                (
                    f"{name} ckpt {ckpt}",
                    {**base, "activation_checkpointing": True, "checkpointing_granularity": ckpt},
                )
            )
        out.append((f"{name} step in bwd", {**base, "step_in_backward": True}))
        if reshard and granularity != "model":
            out += [(f"{name} prefetch {d}", {**base, "prefetch_depth": d}) for d in (0, 2)]
    return out


def replicated_settings():
    """shard_group_size=1 (every rank holds everything: DDP's replication through the engine)."""
    return [
        (
            f"replicated {g} {'zero3' if r else 'zero2'}",
            dict(wrap_granularity=g, reshard_after_forward=r, shard_group_size=1),
        )
        for g, r in (("model", False), ("stage", False), ("block", False), ("block", True))
    ]


def make_engines(args, device):
    """name -> (model, optimizer, knobs or None)."""
    engines = {"ddp": (DDP(build(args.model).to(device)), None)}
    sharded = hybrid_groups(args.shard_group_size)  # the world, no replicas when 0
    replicated = hybrid_groups(1) if args.replicated else None
    chosen = settings() + (replicated_settings() if args.replicated else [])
    for name, knobs in chosen:
        if args.only and name not in args.only:
            continue
        groups = replicated if knobs.get("shard_group_size") == 1 else sharded
        model = build(args.model).to(device)
        if knobs.get("activation_checkpointing"):
            apply_activation_checkpointing(model, knobs["checkpointing_granularity"])
        wrapped = auto_wrap(
            model,
            wrap_policy(False, knobs["wrap_granularity"], model=model),
            groups=groups,
            reshard_after_forward=knobs["reshard_after_forward"],
            root=RootOptions(prefetch_depth=knobs.get("prefetch_depth", 1)),
        )
        engines[name] = (wrapped, knobs)
    for reshard in (True, False):
        if args.only and f"fully_shard {'zero3' if reshard else 'zero2'}" not in args.only:
            continue
        try:
            model = build(args.model).to(device)
            model = torch_fully_shard(
                model, unit_classes(False, "block", model=model), reshard, args.shard_group_size
            )
            engines[f"fully_shard {'zero3' if reshard else 'zero2'}"] = (model, None)
        except (ImportError, RuntimeError) as error:  # older torch: compare what we can
            print(f"fully_shard unavailable: {error}")
    out = {}
    for name, (model, knobs) in engines.items():
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
        if knobs and knobs.get("step_in_backward"):
            model.apply_optimizer_in_backward(optimizer)
        out[name] = (model, optimizer, knobs)
    return out


def step(model, optimizer, x, y, device, in_backward=False):
    if device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    loss = nn.functional.cross_entropy(model(x), y)
    loss.backward()
    if not in_backward:  # else every shard stepped inside backward and holds no gradient
        optimizer.step()
        optimizer.zero_grad(set_to_none=False)  # keep gradients allocated: persistent state
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start


def collectives(model, knobs):
    """The gradient and weight collectives one step of this engine issues:
    [(op, numel, shard numel, group)]."""
    world = dist.group.WORLD
    if knobs is None:  # DDP: all-reduce of its gradient buckets
        total = sum(p.numel() for p in model.parameters())
        first, cap = min(total, DDP_FIRST_BUCKET_MIB * 2**18), DDP_BUCKET_MIB * 2**18  # fp32 elements
        sizes = [first] + [min(cap, total - start) for start in range(first, total, cap)]
        return [("all_reduce", n, n, world) for n in sizes]
    ops = []
    for unit in model.units():
        gathers = 1 if (not knobs["reshard_after_forward"] or unit is model) else 2
        for handle in unit.unit_state.handles:
            full, shard, groups = handle.full.numel(), handle.shard.numel(), handle.groups
            ops += [("all_gather", full, shard, groups.shard)] * gathers
            ops.append(("reduce_scatter", full, shard, groups.shard))
            if groups.replica is not None:  # hybrid: the shard gradient across the groups
                ops.append(("all_reduce", shard, shard, groups.replica))
    return ops


def time_collectives(ops, device, repeats):
    """Median seconds of issuing ``ops`` back to back (what one step's communication costs alone),
    through the engine's own collective helpers (on gloo: list all-gather, in-place all-reduce)."""
    buffers = {n: torch.zeros(n, device=device) for _, full, shard, _ in ops for n in (full, shard)}
    times = []
    for _ in range(repeats):
        dist.barrier()
        start = time.perf_counter()
        for op, full, shard, group in ops:
            if op == "all_reduce":
                dist.all_reduce(buffers[full], group=group)
            elif op == "all_gather":
                gather_into(buffers[full], buffers[shard], group, async_op=False)
            else:
                reduce_scatter_into(buffers[full], 0, shard, group)[0].wait()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def worker(rank, world, args):
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))  # as the launcher does
    device = torch.device("cuda", rank) if torch.cuda.is_available() else torch.device("cpu")
    engines = make_engines(args, device)
    times = {name: [] for name in engines}
    gen = torch.Generator().manual_seed(rank)
    names = list(engines)
    for i in range(args.steps + args.warmup):
        x = torch.randn(args.batch, 3, args.size, args.size, generator=gen).to(device)
        y = torch.randint(0, 10, (args.batch,), generator=gen).to(device)
        for name in names[i % len(names) :] + names[: i % len(names)]:  # rotate: no engine always first
            model, optimizer, knobs = engines[name]
            elapsed = step(
                model, optimizer, x, y, device, in_backward=bool(knobs and knobs.get("step_in_backward"))
            )
            if i >= args.warmup:
                times[name].append(elapsed)
    floors = {}
    for name, (model, _, knobs) in engines.items():
        if name.startswith("fully_shard"):
            continue
        ops = collectives(model, knobs)
        key = tuple(ops)
        floors[name] = floors.get(key) or time_collectives(ops, device, args.steps)
        floors[key] = floors[name]
    return {
        "median_s": {name: statistics.median(t) for name, t in times.items()},
        "floor_s": {k: v for k, v in floors.items() if isinstance(k, str)},
        "bytes": {name: storage_bytes(held_tensors(*engines[name][:2])) for name in engines},
        "knobs": {name: knobs for name, (_, _, knobs) in engines.items()},
    }


def measured_factors(ratio, knobs_of):
    """The vistrain.planner.knobs factors as this run measured them."""
    base = {
        (k["wrap_granularity"], k["reshard_after_forward"]): ratio[n]
        for n, k in knobs_of.items()
        if k and set(k) == {"wrap_granularity", "reshard_after_forward"}
    }

    def relative(select, key, added=False):  # median over the settings of the ratio (or the difference)
        out = {}
        for name, k in knobs_of.items():
            if k and select(k):
                reference = base[(k["wrap_granularity"], k["reshard_after_forward"])]
                out.setdefault(key(k), []).append(
                    ratio[name] - reference if added else ratio[name] / reference
                )
        return {key: statistics.median(v) for key, v in out.items()}

    replicated = {
        (k["wrap_granularity"], k["reshard_after_forward"]): ratio[n]
        for n, k in knobs_of.items()
        if k and k.get("shard_group_size") == 1
    }
    return {
        "STEP_VS_DDP": base,
        "REPLICATED_VS_DDP": replicated,
        "CHECKPOINTING_EXTRA": relative(
            lambda k: k.get("activation_checkpointing"), lambda k: k["checkpointing_granularity"], added=True
        ),
        "PREFETCH_COST": relative(lambda k: "prefetch_depth" in k, lambda k: k["prefetch_depth"]),
        "IN_BACKWARD_COST": relative(lambda k: k.get("step_in_backward"), lambda k: True),
    }


def order_agreement(ratio, knobs_of, device, tolerance=0.05):
    """(pairs the planner orders as measured, pairs compared, disagreements), over the pairs of
    settings whose measured step times differ by more than ``tolerance``."""
    names = [n for n, k in knobs_of.items() if k]
    agree, pairs, wrong = 0, 0, []
    for a, b in itertools.combinations(names, 2):
        if abs(ratio[a] / ratio[b] - 1) <= tolerance:
            continue
        pairs += 1
        planned = speed_cost(knobs_of[a], device) - speed_cost(knobs_of[b], device)
        if planned * (ratio[a] - ratio[b]) > 0:
            agree += 1
        else:
            wrong.append(f"{a} vs {b}")
    return agree, pairs, wrong


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--size", type=int, default=64)
    parser.add_argument("--model", default="regnet_y_400mf")
    parser.add_argument(
        "--trim-after-mib", type=float, default=None, help="heap trims after this many MiB freed"
    )
    parser.add_argument("--shard-group-size", type=int, default=0, help="hybrid: ranks per shard group")
    parser.add_argument("--replicated", action="store_true", help="also shard_group_size=1 (replication)")
    parser.add_argument("--only", nargs="*", help="only these settings (and DDP), names as printed")
    args = parser.parse_args()
    if args.trim_after_mib is not None:  # the ranks are forked from here and inherit it
        model_state.TRIM_AFTER_BYTES = int(args.trim_after_mib * 2**20)
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    device = "cuda" if torch.cuda.is_available() else "cpu"
    results = run_on_ranks(worker, args.world, args, backend=backend)
    r0 = results[0]

    def slowest(key, name):  # the slowest rank sets the pace
        return max(r[key][name] for r in results)

    ddp_time = slowest("median_s", "ddp")
    sharing = args.shard_group_size or args.world
    threads = max(1, (os.cpu_count() or 1) // args.world)
    print(
        f"{args.model}, {args.size}x{args.size}, batch {args.batch}/rank, {args.world} ranks x {threads} threads"
        f"{f', shard groups of {sharing}' if sharing < args.world else ''}, {device}/{backend}, "
        f"median of {args.steps} steps"
    )
    print(
        f"{'setting':<26} {'step s':>7} {'vs DDP':>7} {'floor':>7} {'planner':>8} {'MB/rank':>8} {'vs DDP/' + str(sharing):>8}"
    )
    ratio = {}
    for name in r0["median_s"]:
        t = slowest("median_s", name)
        ratio[name] = t / ddp_time
        floor = f"{slowest('floor_s', name) / ddp_time:7.2f}" if name in r0["floor_s"] else f"{'-':>7}"
        knobs = r0["knobs"][name]
        cost = (
            f"{speed_cost(knobs, device):8.2f}"
            if knobs
            else (f"{1.0:8.2f}" if name == "ddp" else f"{'-':>8}")
        )
        b = slowest("bytes", name)
        print(
            f"{name:<26} {t:7.3f} {ratio[name]:7.2f} {floor} {cost} {b / 2**20:8.2f} {b / (r0['bytes']['ddp'] / sharing):8.3f}"
        )
    print("floor: the step's gathers and reductions (DDP: bucket all-reduces) timed alone, / DDP's step")
    knobs_of = r0["knobs"]
    print("factors measured here (vistrain/planner/knobs.py):")
    for table, values in measured_factors(ratio, knobs_of).items():
        print(f"  {table}: " + ", ".join(f"{k}: {v:.2f}" for k, v in values.items()))
    agree, pairs, wrong = order_agreement(ratio, knobs_of, device)
    print(
        f"planner's speed order agrees with the measured one on {agree} of {pairs} pairs that differ by > 5%"
    )
    for pair in wrong:
        print(f"  disagrees: {pair}")


if __name__ == "__main__":
    main()
