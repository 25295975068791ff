"""Small models and a DDP-vs-FSDP training harness shared by the engine's multi-rank tests."""

import copy

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from vistrain.fsdp import FullyShardedDataParallel as FSDP
from vistrain.fsdp import auto_wrap, by_class


class Block(nn.Module):
    def __init__(self, channels):
        super().__init__()
        self.conv = nn.Conv2d(channels, channels, 3, padding=1)
        self.proj = nn.Conv2d(channels, channels, 1, bias=False)

    def forward(self, x):
        return x + self.proj(torch.relu(self.conv(x)))


class TokenBlock(nn.Module):
    """A residual MLP block on tokens (N, T, width): ``x + MLP(x)``."""

    def __init__(self, width):
        super().__init__()
        self.mlp = nn.Sequential(nn.Linear(width, 2 * width), nn.GELU(), nn.Linear(2 * width, width))

    def forward(self, x):
        return x + self.mlp(x)


class Net(nn.Module):
    """Parameter counts that no world size up to 4 divides evenly; ``twice`` runs twice per step."""

    def __init__(self, channels=5, classes=7):
        super().__init__()
        self.stem = nn.Conv2d(3, channels, 3, padding=1)
        self.blocks = nn.Sequential(Block(channels), Block(channels))
        self.head = nn.Linear(channels, classes)
        self.twice = nn.Linear(classes, classes)

    def forward(self, x):
        x = self.blocks(self.stem(x)).mean((2, 3))
        x = self.head(x)
        return self.twice(torch.relu(self.twice(x)))


def make_net(seed=0):
    torch.manual_seed(seed)
    return Net()


def global_batch(step, world, per_rank=4, size=6):
    gen = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(world * per_rank, 3, size, size, generator=gen)
    y = torch.randint(0, 7, (world * per_rank,), generator=gen)
    return x, y


def local_batch(step, rank, world, per_rank=4):
    x, y = global_batch(step, world, per_rank)
    return x[rank * per_rank : (rank + 1) * per_rank], y[rank * per_rank : (rank + 1) * per_rank]


def gathered_bytes(model) -> int:
    """Bytes of gathered (full) weights the units of ``model`` hold now."""
    return sum(h.full.untyped_storage().nbytes() for u in model.units() for h in u.unit_state.handles)


def wrap(model, nested, **kwargs):
    if nested:
        return auto_wrap(model, by_class([Block, nn.Linear]), **kwargs)
    return FSDP(model, **kwargs)


def make_optimizer(name, params):
    if name == "sgd":
        return torch.optim.SGD(params, lr=0.1, momentum=0.9, weight_decay=1e-4)
    return torch.optim.AdamW(params, lr=0.01, weight_decay=0.01)


def train(model, optimizer, rank, world, steps=10, clip=None):
    losses = []
    for step in range(steps):
        x, y = local_batch(step, rank, world)
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        if clip is not None:
            if isinstance(model, FSDP):
                model.clip_grad_norm_(clip)
            else:
                torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        reported = loss.detach().clone()
        dist.all_reduce(reported)
        losses.append(reported.item() / world)
    return losses


def ddp_reference(optim_name, rank, world, steps=10, clip=None):
    ddp = DDP(make_net())
    opt = make_optimizer(optim_name, ddp.parameters())
    losses = train(ddp, opt, rank, world, steps, clip)
    return losses, {k: v.detach().clone() for k, v in ddp.module.state_dict().items()}


def max_rel_diff(a, b):
    """Worst relative error max|a-b| / max|b| over matching tensors of two state dicts (or lists)."""
    if isinstance(a, dict):
        assert a.keys() == b.keys(), (sorted(a), sorted(b))
        return max(max_rel_diff(a[k], b[k]) for k in a)
    a, b = torch.as_tensor(a, dtype=torch.float64), torch.as_tensor(b, dtype=torch.float64)
    assert a.shape == b.shape, (a.shape, b.shape)
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-12)).item()


def copy_model(model):
    return copy.deepcopy(model)
