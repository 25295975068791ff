"""Offline conversions of a sharded checkpoint (``tools/convert_checkpoint.py``).

* :func:`consolidate`: one plain state-dict file (``model.load_state_dict(torch.load(f))``).
* :func:`describe`: what a checkpoint holds, as text.
* the trunk alone for torchvision, timm or as safetensors: ``export.py``, with its model card
  (``model_card.py``).

The output is streamed (``tensor_file.save_streamed``): each tensor is assembled from the slices
in the rank files, written at its place in the output file and dropped before the next one, so
the tool holds one tensor at a time, never the whole model (the written bytes sit in the OS page
cache, which the OS can drop). :func:`consolidated_state_dict` is the in-memory form (tests, small
models).
"""

import math
from collections import Counter, OrderedDict
from typing import Dict, Optional

import torch

from vistrain.checkpoint.pretrained import WeightsSource
from vistrain.checkpoint.tensor_file import save_streamed
from vistrain.config.words import plural


def consolidated_state_dict(path: str, prefix: str = "") -> "OrderedDict[str, torch.Tensor]":
    """Full state dict (parameters and buffers) of the checkpoint, run folder or file ``path``;
    only keys starting with ``prefix``."""
    source = WeightsSource(path)
    return OrderedDict((key, source.read(key)) for key in source.shapes() if key.startswith(prefix))


def consolidate(path: str, out: str) -> int:
    """Write the plain state dict of ``path`` to ``out`` (atomically, one tensor in memory at a
    time). Returns the tensor count."""
    source = WeightsSource(path)
    specs = source.specs()
    save_streamed(out, specs, source.read)
    return len(specs)


def describe(path: str) -> str:
    """Human-readable summary: progress, world size, parameters, optimizer state kinds."""
    source = WeightsSource(path)
    reader = source.reader
    if reader is None:
        shapes = source.shapes()
        nested = getattr(source.file, "nested", "")
        where = f" (under {nested!r})" if nested else ""
        return (
            f"{source.path}: state dict{where}, {plural(len(shapes), 'tensor')}, "
            f"{sum(math.prod(s) for s in shapes.values()):,} elements"
        )
    meta = reader.meta
    params = meta["params"]
    lines = [
        f"{source.path}",
        f"  iteration {meta['iteration']}, epoch {meta.get('epoch')}, "
        f"{meta.get('iteration_in_epoch')} of {meta.get('iters_per_epoch')} iterations into it",
        f"  written by {plural(meta['world_size'], 'rank')}, vistrain {meta['vistrain_version']}, torch "
        f"{meta['torch_version']}, {meta['created']}",
        f"  {len(params)} parameters, {sum(math.prod(p['shape']) for p in params.values()):,} elements "
        f"({sum(not p['requires_grad'] for p in params.values())} frozen); {len(meta['buffers'])} buffers",
        f"  dtypes: {dict(Counter(p['dtype'] for p in params.values()))}",
    ]
    lines += [f"  {group}: {n} parameters" for group, n in _top_level_counts(params).items()]
    lines.append(_optimizer_line(meta.get("optimizer")))
    largest = sorted(params.items(), key=lambda kv: -math.prod(kv[1]["shape"]))[:5]
    lines += [f"  largest: {fqn} {tuple(info['shape'])}" for fqn, info in largest]
    return "\n".join(lines)


def _top_level_counts(params: dict) -> Dict[str, int]:
    return dict(Counter(fqn.split(".", 1)[0] for fqn in params))


def _optimizer_line(info: Optional[dict]) -> str:
    if info is None:
        return "  optimizer: none saved"
    groups = ", ".join(
        f"{g.get('name', i)} ({len(g['params'])} params)" for i, g in enumerate(info["param_groups"])
    )
    return (
        f"  optimizer {info['class']}: state tensors {info['tensor_state']}, "
        f"per-shard scalars {info['scalar_state']}; groups: {groups}"
    )
