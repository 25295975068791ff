"""DDP vs vistrain's sharded engine vs PyTorch's fully_shard, side by side in the same processes.

    python dev/bench_fsdp.py [--world 2] [--steps 12] [--batch 8] [--size 64] [--model regnet_y_400mf]
                             [--shard-group-size K]

Each rank builds the models from the same seed and, step after step, runs one training step of
each in turn on the same data, so machine noise hits all alike. Ours and fully_shard run with
reshard_after_forward on (ZeRO-3, the default) and off ("keep": ZeRO-2, one gather per step).
Prints the median step time of each as a ratio to DDP's, per-rank persistent storage bytes
(parameters + gradients + buffers + SGD momentum + the engine's own buffers, counted by
``untyped_storage().nbytes()`` once per storage) next to DDP's / N (N: the ranks sharing the shards),
and the peak bytes of gathered (full) parameters next to the two largest units. On CPU it uses gloo;
with CUDA, NCCL. ``--shard-group-size K`` compares hybrid sharding side by side: ours with shard
groups of K consecutive ranks and replicas across them, fully_shard on a 2-D (replicate, shard)
mesh of the same layout.
"""

import argparse
import statistics
import time

import torch
import torchvision
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torchvision.models.regnet import ResBottleneckBlock, SimpleStemIN

from vistrain.distributed.testing import run_on_ranks
from vistrain.fsdp import auto_wrap, by_class, heap, hybrid_groups
from vistrain.fsdp.memory import held_tensors, peak_rss_mib, storage_bytes
from vistrain.runtime.sharding import torch_mesh

UNIT_CLASSES = (ResBottleneckBlock, SimpleStemIN, nn.Linear)  # blocks, stem, classifier


def build(name):
    torch.manual_seed(0)
    return getattr(torchvision.models, name)(num_classes=10)


def make_engines(args, device):
    """DDP, then ours and fully_shard with reshard_after_forward on (ZeRO-3) and off (ZeRO-2);
    ours also without giving freed heap pages back (``release_host_memory=False``, the engine
    before it trimmed) and with the optimizer step inside backward."""
    engines = {"ddp": DDP(build(args.model).to(device))}
    shard_group, replica_group = hybrid_groups(args.shard_group_size)  # WORLD, None when 0
    for reshard, suffix in ((True, ""), (False, " (keep)")):
        engines["vistrain" + suffix] = auto_wrap(
            build(args.model).to(device),
            by_class(UNIT_CLASSES),
            reshard_after_forward=reshard,
            process_group=shard_group,
            replica_group=replica_group,
        )
        try:
            engines["fully_shard" + suffix] = torch_fully_shard(
                build(args.model).to(device), reshard, args.shard_group_size
            )
        except (ImportError, RuntimeError) as error:  # older torch: compare what we can
            print(f"fully_shard unavailable: {error}")
    groups = dict(process_group=shard_group, replica_group=replica_group)
    engines["vistrain (no trim)"] = auto_wrap(
        build(args.model).to(device), by_class(UNIT_CLASSES), release_host_memory=False, **groups
    )
    engines["vistrain (step in bwd)"] = auto_wrap(
        build(args.model).to(device), by_class(UNIT_CLASSES), **groups
    )
    out = {
        name: (model, torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9))
        for name, model in engines.items()
    }
    model, optimizer = out["vistrain (step in bwd)"]
    model.apply_optimizer_in_backward(optimizer)
    return out


def torch_fully_shard(model, reshard, shard_group_size):
    from torch.distributed.fsdp import fully_shard

    mesh = torch_mesh(next(model.parameters()).device.type, shard_group_size)  # 2-D when hybrid
    for module in model.modules():
        if isinstance(module, UNIT_CLASSES):
            fully_shard(module, mesh=mesh, reshard_after_forward=reshard)
    return fully_shard(model, mesh=mesh, reshard_after_forward=reshard)


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


def persistent_bytes(model, optimizer):
    """Storage bytes (whole storages, each once) of parameters, gradients, buffers, optimizer
    state and, for ours, the engine's own buffers: a view into a larger buffer counts it all."""
    return storage_bytes(held_tensors(model, optimizer))


def worker(rank, world, args):
    device = torch.device("cuda", rank) if torch.cuda.is_available() else torch.device("cpu")
    engines = make_engines(args, device)
    times = {name: [] for name in engines}
    gen = torch.Generator().manual_seed(rank)
    peak = 0
    for i in range(args.steps + args.warmup):
        x = torch.randn(args.batch, 3, args.size, args.size, generator=gen).to(device)
        y = torch.randint(0, 10, (args.batch,), generator=gen).to(device)
        names = list(engines)
        for name in names[i % len(names) :] + names[: i % len(names)]:  # rotate: no engine always first
            model, optimizer = engines[name]
            gathered = model.model_state.gathered if name == "vistrain" and model.model_state else None
            if gathered is not None:  # peak over its step alone
                gathered.reset_peak()
            elapsed = step(model, optimizer, x, y, device, in_backward="step in bwd" in name)
            if name == "vistrain":
                peak = max(peak, model.model_state.gathered.peak)
            if i >= args.warmup:
                times[name].append(elapsed)
    ours = engines["vistrain"][0]
    units = sorted(
        (sum(h.full.numel() * h.full.element_size() for h in u.unit_state.handles) for u in ours.units()),
        reverse=True,
    )
    return {
        "median_s": {name: statistics.median(t) for name, t in times.items()},
        "bytes": {name: persistent_bytes(*engines[name]) for name in engines},
        "peak_gathered": peak,
        "two_largest_units": sum(units[:2]),
        "peak_rss_mib": peak_rss_mib(),
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--size", type=int, default=64)
    parser.add_argument("--model", default="regnet_y_400mf")
    parser.add_argument(
        "--trim-after-mib",
        type=float,
        default=None,
        help="heap trims after this many MiB freed (engine default 256)",
    )
    parser.add_argument("--shard-group-size", type=int, default=0, help="hybrid: ranks per shard group")
    args = parser.parse_args()
    if args.trim_after_mib is not None:  # the ranks are forked from here and inherit it
        heap.TRIM_AFTER_BYTES = int(args.trim_after_mib * 2**20)
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    results = run_on_ranks(worker, args.world, args, backend=backend)
    r0 = results[0]
    ddp_time = max(r["median_s"]["ddp"] for r in results)
    ddp_bytes = r0["bytes"]["ddp"]
    sharing = args.shard_group_size or args.world
    layout = f", shard groups of {sharing}" if sharing < args.world else ""
    print(
        f"{args.model}, {args.size}x{args.size}, batch {args.batch}/rank, {args.world} ranks{layout}, "
        f"{'cuda/nccl' if torch.cuda.is_available() else 'cpu/gloo'}, median of {args.steps} steps"
    )
    print(f"{'engine':<20} {'step s':>8} {'vs DDP':>7} {'MB/rank':>9} {'vs DDP/' + str(sharing):>9}")
    for name in r0["median_s"]:
        t = max(r["median_s"][name] for r in results)  # the slowest rank sets the pace
        b = max(r["bytes"][name] for r in results)
        print(f"{name:<20} {t:8.3f} {t / ddp_time:7.2f} {b / 2**20:9.2f} {b / (ddp_bytes / sharing):9.3f}")
    print(
        f"vistrain peak gathered parameters: {r0['peak_gathered'] / 2**20:.2f} MB; two largest units: "
        f"{r0['two_largest_units'] / 2**20:.2f} MB"
    )
    rss = max(r["peak_rss_mib"] for r in results)
    print(f"peak RSS per rank (all engines share each process): {rss:.0f} MiB")


if __name__ == "__main__":
    main()
