"""Prints the step time of a ViT called by name with gather_public_methods over the same step with the methods registered by hand, and the per-call cost of the write check.

    python dev/bench/bench_gather_methods.py [--steps 20] [--calls 50] [--batch 8] [--width 192] [--depth 4]

A small ViT-like trunk (patch embedding, ``--depth`` pre-norm attention blocks, each its own unit,
the trunk a unit too, under a root) is called by name as SSL clients call theirs: per step
``trunk.forward_features(images)`` and ``trunk.encode(images, keep)`` (a quarter of the tokens,
as an MAE encoder), a loss, backward, SGD. Two models in the same 2 gloo ranks (one thread each),
their steps alternating on the same data: ``registered`` (``register_forward_method(trunk,
"forward_features", "encode")``, the option off) and ``auto`` (``gather_public_methods=True``, no
registration). Printed, as wall time and as the main thread's CPU time (``time.thread_time``:
steadier on a shared machine): the median step of each and their ratio (the slower rank's), the
same for one ``forward_features`` call under ``no_grad``, then the CPU difference per call, the
torch operations ``WriteGuard`` saw in it (the blocks' own gathers included) and the difference
per operation.
"""

import argparse
import statistics
import time

import torch
from torch import nn

from vistrain.distributed.testing import run_on_ranks
from vistrain.fsdp import auto_wrap, by_class, register_forward_method
from vistrain.fsdp.gathered_writes import WriteGuard

CLOCKS = ("wall", "cpu")  # time.perf_counter; time.thread_time (the main thread: where the check runs)


class Block(nn.Module):
    """Pre-norm self-attention and MLP on tokens (N, T, D)."""

    def __init__(self, width: int, heads: int = 3):
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv, self.proj = nn.Linear(width, 3 * width), nn.Linear(width, width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

    def forward(self, x):
        n, t, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(n, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        attended = nn.functional.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(n, t, d)
        x = x + self.proj(attended)
        return x + self.mlp(self.norm2(x))


class Trunk(nn.Module):
    """Images (N, 3, S, S) -> tokens (N, 1 + T, D): timm's ``forward_features``, an MAE's ``encode``."""

    def __init__(self, size: int, width: int, depth: int, patch: int = 8):
        super().__init__()
        self.patch_embed = nn.Conv2d(3, width, patch, stride=patch)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, width))
        self.pos_embed = nn.Parameter(torch.randn(1, (size // patch) ** 2, width) * 0.02)
        self.blocks = nn.ModuleList(Block(width) for _ in range(depth))
        self.norm = nn.LayerNorm(width)

    def forward_features(self, images):
        return self.encode(images, None)

    def encode(self, images, keep):
        x = self.patch_embed(images).flatten(2).transpose(1, 2) + self.pos_embed
        if keep is not None:
            x = x.gather(1, keep[..., None].expand(-1, -1, x.shape[-1]))
        x = torch.cat([self.cls_token.expand(x.shape[0], -1, -1), x], 1)
        for block in self.blocks:
            x = block(x)
        return self.norm(x)


class Client(nn.Module):
    def __init__(self, size: int, width: int, depth: int):
        super().__init__()
        self.trunk = Trunk(size, width, depth)
        self.head = nn.Linear(width, 10)

    def forward(self, images, keep):
        features = self.trunk.forward_features(images)[:, 0]
        encoded = self.trunk.encode(images, keep)
        return self.head(features).logsumexp(1).mean() + encoded.pow(2).mean()


def _model(args, auto: bool):
    torch.manual_seed(0)
    client = Client(args["size"], args["width"], args["depth"])
    if not auto:
        register_forward_method(client.trunk, "forward_features", "encode")
    return auto_wrap(client, by_class({Block: {}, Trunk: {}}), gather_public_methods=auto)


def _watched_ops(fn) -> int:
    """Torch operations ``WriteGuard`` saw while ``fn()`` ran (counted by wrapping its hook)."""
    seen = []
    original = WriteGuard.__torch_function__

    def counted(self, func, types, args=(), kwargs=None):
        seen.append(func)
        return original(self, func, types, args, kwargs)

    WriteGuard.__torch_function__ = counted
    try:
        fn()
    finally:
        WriteGuard.__torch_function__ = original
    return len(seen)


def worker(rank, world, args):
    torch.set_num_threads(1)
    models = {"registered": _model(args, False), "auto": _model(args, True)}
    optimizers = {k: torch.optim.SGD(m.parameters(), lr=0.01) for k, m in models.items()}
    gen = torch.Generator().manual_seed(rank)
    images = torch.randn(args["batch"], 3, args["size"], args["size"], generator=gen)
    tokens = (args["size"] // 8) ** 2
    keep = torch.rand(args["batch"], tokens, generator=gen).argsort(1)[:, : tokens // 4]

    def step(name):
        models[name](images, keep).backward()
        optimizers[name].step()
        optimizers[name].zero_grad()

    def call(name):
        with torch.no_grad():
            models[name].module.trunk.forward_features(images)

    out = {}
    for what, fn, repeats in (("step", step, args["steps"]), ("call", call, args["calls"])):
        times = {(name, clock): [] for name in models for clock in CLOCKS}
        for i in range(repeats + 2):
            for name in ("registered", "auto") if i % 2 else ("auto", "registered"):
                start = (time.perf_counter(), time.thread_time())
                fn(name)
                end = (time.perf_counter(), time.thread_time())
                if i >= 2:  # warm-up: lazy init, first gathers
                    for clock, a, b in zip(CLOCKS, start, end):
                        times[(name, clock)].append(b - a)
        for (name, clock), t in times.items():
            out[f"{what} {name} {clock}"] = statistics.median(t)
    out["ops"] = _watched_ops(lambda: call("auto"))
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--calls", type=int, default=50)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--size", type=int, default=64)
    parser.add_argument("--width", type=int, default=192)
    parser.add_argument("--depth", type=int, default=4)
    args = vars(parser.parse_args())
    results = run_on_ranks(worker, 2, args)
    print(
        f"ViT-like trunk, {args['depth']} blocks of width {args['width']}, {args['size']}x{args['size']} "
        f"images in 8x8 patches, batch {args['batch']}/rank, 2 gloo ranks x 1 thread; medians, the "
        "slower rank's ratio"
    )
    for what, key, n in (
        ("step", "step", args["steps"]),
        ("forward_features (no_grad)", "call", args["calls"]),
    ):
        cells = []
        for clock in CLOCKS:
            reg = max(r[f"{key} registered {clock}"] for r in results)
            auto = max(r[f"{key} auto {clock}"] for r in results)
            ratio = max(r[f"{key} auto {clock}"] / r[f"{key} registered {clock}"] for r in results)
            cells.append(f"{clock} {1e3 * reg:7.2f} / {1e3 * auto:7.2f} ms = {ratio:.3f}")
        print(f"  {what:<27} registered / auto: " + "   ".join(cells) + f"  ({n} each)")
    extra = max(r["call auto cpu"] - r["call registered cpu"] for r in results)
    ops = results[0]["ops"]
    print(
        f"  auto - registered, CPU per forward_features call: {1e6 * extra:.0f} us over the {ops} torch "
        f"operations the write check saw: {1e6 * extra / ops:.2f} us each"
    )


if __name__ == "__main__":
    main()
