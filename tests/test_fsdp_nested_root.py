"""A wrapped model inside an ordinary module: the parent's state_dict / load_state_dict see every
key, for each way units can sit in a plain tree (Lightning holds the engine this way)."""

import copy

import pytest
import torch
from fsdp_models import Block, Net, max_rel_diff
from torch import nn

from vistrain.distributed.testing import run_on_ranks
from vistrain.fsdp import FullyShardedDataParallel as FSDP
from vistrain.fsdp import auto_wrap, by_class


class Holder(nn.Module):
    """Own parameter and BatchNorm buffers beside one or two sub-networks."""

    def __init__(self, seed, twins=False, deep=False):
        super().__init__()
        torch.manual_seed(seed)
        self.scale = nn.Parameter(torch.randn(7))
        self.norm = nn.BatchNorm1d(7)
        self.net = nn.Sequential(Net()) if deep else Net()
        self.twin = Net() if twins else None

    def forward(self, x):
        out = self.net(x)
        if self.twin is not None:
            out = out + self.twin(x)
        return self.norm(out * self.scale)


def _nested_root(model):  # the root with nested units, as a plain module's child
    model.net = auto_wrap(model.net, by_class([Block, nn.Linear]))
    return model, None


def _flat_root(model):  # one unit, no nested ones
    model.net = FSDP(model.net)
    return model, None


def _deep_root(model):  # plain -> plain -> root
    model.net[0] = auto_wrap(model.net[0], by_class([Block]))
    return model, None


def _sibling_roots(model):  # two separately wrapped models side by side
    model.net = auto_wrap(model.net, by_class([Block]))
    model.twin = FSDP(model.twin)
    return model, None


def _inside_root(model):  # the module a root wraps, asked directly (a LightningModule mid-fit)
    root = auto_wrap(model.net, by_class([Block, nn.Linear, nn.Conv2d]))
    with torch.no_grad():  # the root's first forward makes the units below it non-roots
        root(torch.zeros(1, 3, 6, 6))
    return root.module, root


SHAPES = {
    "nested_root": (_nested_root, {}),
    "flat_root": (_flat_root, {}),
    "deep_root": (_deep_root, {"deep": True}),
    "sibling_roots": (_sibling_roots, {"twins": True}),
    "inside_root": (_inside_root, {}),
}


def _shape_worker(rank, world, shape):
    build, kwargs = SHAPES[shape]
    plain = Holder(seed=0, **kwargs)
    other = Holder(seed=1, **kwargs)  # different values for every key
    with torch.no_grad():
        for buf in other.buffers():
            buf.add_(3)
    wrapped, _root = build(copy.deepcopy(plain))
    if shape == "inside_root":
        plain, other = plain.net, other.net
    saved = wrapped.state_dict()
    keys_equal = list(saved) == list(plain.state_dict())
    saved_diff = max_rel_diff(dict(saved), dict(plain.state_dict()))

    result = wrapped.load_state_dict(other.state_dict())
    loaded_diff = max_rel_diff(dict(wrapped.state_dict()), dict(other.state_dict()))
    x = torch.randn(4, 3, 6, 6, generator=torch.Generator().manual_seed(rank))
    wrapped.eval(), other.eval()
    with torch.no_grad():
        output_diff = max_rel_diff(wrapped(x), other(x))

    broken = dict(other.state_dict())
    removed = next(k for k in broken if k.endswith("head.weight"))
    del broken[removed]
    broken["net.extra"] = torch.zeros(1)
    with pytest.raises(RuntimeError) as info:
        wrapped.load_state_dict(broken)
    lenient = wrapped.load_state_dict(broken, strict=False)
    return {
        "keys_equal": keys_equal,
        "saved": saved_diff,
        "loaded": loaded_diff,
        "output": output_diff,
        "clean": not result.missing_keys and not result.unexpected_keys,
        "strict_names": removed in str(info.value) and "net.extra" in str(info.value),
        "lenient": (lenient.missing_keys, lenient.unexpected_keys) == ([removed], ["net.extra"]),
    }


@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_plain_parent_sees_every_key_of_wrapped_children(shape):
    for out in run_on_ranks(_shape_worker, 2, shape):
        assert out["keys_equal"] and out["clean"], out
        assert out["saved"] == 0 and out["loaded"] == 0 and out["output"] < 1e-6, out
        assert out["strict_names"] and out["lenient"], out
