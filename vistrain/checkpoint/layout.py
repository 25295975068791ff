"""Which slices of which ORIGINAL parameters this rank holds, whatever wraps the model.

Everything in a checkpoint is keyed by the original parameter's clean name (``fqn``, e.g.
``trunk.stem.0.weight``) and an element range of the flattened parameter, so a checkpoint does
not depend on the world size or on the wrapper:

* sharded engine (``vistrain.fsdp``): every ``model.parameters()`` entry is this rank's part of
  one original parameter (``local_part``: a range of its flattened elements, maybe empty);
  with hybrid sharding (shard groups smaller than the world, replicated across groups) only the
  ranks of the first replica write their shards, so each shard is on disk once;
* DDP or a plain module: every parameter is whole and replicated; rank 0 alone writes it.

A checkpoint may hold several models distributed alike, named by a prefix (a student and its
momentum teacher: ``{"": student, "teacher.": teacher}``): their layouts are joined, the
prefix leading every fqn and buffer name.
"""

from dataclasses import dataclass, replace
from typing import Dict, List, Mapping, Union

import torch
from torch import nn

from vistrain.checkpoint.files import CheckpointError
from vistrain.distributed import comm
from vistrain.fsdp import Backend, FullyShardedDataParallel, backend_of, local_part, unwrap
from vistrain.fsdp.ownership import clean_name
from vistrain.torch_compat import persistent_buffer_names


@dataclass(frozen=True)
class Segment:
    """One contiguous range of an original parameter inside a local tensor."""

    fqn: str
    offset: int  # first element inside the local flat tensor
    start: int  # first element inside the flattened original parameter
    length: int


@dataclass
class LocalParam:
    """A tensor the optimizer sees on this rank and the original-parameter ranges it holds."""

    tensor: torch.Tensor  # a flat shard (sharded engine) or a whole parameter
    segments: List[Segment]


@dataclass
class ModelLayout:
    """This rank's view of a model for checkpointing."""

    params: List[LocalParam]
    infos: Dict[str, dict]  # fqn -> {"shape": [..], "dtype": "float32", "requires_grad": bool}
    buffers: Dict[str, torch.Tensor]  # persistent buffers by clean name
    writes_params: bool  # False on ranks > 0 of a replicated model (rank 0 writes everything)
    sharded: bool


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def model_layout(model: Union[nn.Module, Mapping[str, nn.Module]]) -> ModelLayout:
    """The layout of ``model``: our sharded engine, DDP or a plain module, or a mapping of name
    prefixes to such models (joined).

    PyTorch's ``fully_shard`` (``TorchShardedModel``) goes through :mod:`torch_backend` instead.
    """
    if isinstance(model, Mapping):
        return _joined_layout({prefix: model_layout(m) for prefix, m in model.items()})
    backend = backend_of(model)
    if backend is Backend.TORCH:
        raise TypeError("TorchShardedModel goes through vistrain.checkpoint.torch_backend")
    if backend is Backend.BUILTIN:
        return _sharded_layout(model)
    return _replicated_layout(unwrap(model))


def _sharded_layout(model: FullyShardedDataParallel) -> ModelLayout:
    params, infos, first_replica = [], {}, True
    world = comm.get_world_size()
    for param in model.parameters():
        part = local_part(param)
        if part is None:
            raise TypeError(
                "a parameter of the sharded model is not held by the engine; wrap the whole model"
            )
        handle = part.handle
        if handle.world_size * handle.groups.replicas != world:
            raise NotImplementedError(
                f"shards over {handle.world_size} ranks with {handle.groups.replicas} replica(s) do not "
                f"cover the {world} ranks of the job; vistrain.checkpoint needs shard groups that "
                "tile the world (full or hybrid sharding)"
            )
        first_replica = first_replica and handle.groups.replica_rank == 0
        fqn = part.origin.fqn
        segments = [Segment(fqn, 0, part.start, part.length)] if part.length else []
        params.append(LocalParam(param, segments))
        infos[fqn] = {
            "shape": list(part.origin.shape),
            "dtype": dtype_name(param.dtype),
            "requires_grad": param.requires_grad,
        }
    # hybrid: the other replicas hold the same shards; one copy on disk
    return ModelLayout(params, infos, persistent_buffers(model), writes_params=first_replica, sharded=True)


def _joined_layout(layouts: Mapping[str, ModelLayout]) -> ModelLayout:
    writes = {layout.writes_params for layout in layouts.values()}
    if len(writes) != 1:
        raise NotImplementedError(
            "a checkpoint's models must be distributed alike (all sharded or all replicated)"
        )
    params, infos, buffers = [], {}, {}
    for prefix, layout in layouts.items():
        for local in layout.params:
            segments = [replace(seg, fqn=prefix + seg.fqn) for seg in local.segments]
            params.append(LocalParam(local.tensor, segments))
        infos.update({prefix + fqn: info for fqn, info in layout.infos.items()})
        buffers.update({prefix + name: buf for name, buf in layout.buffers.items()})
    sharded = any(layout.sharded for layout in layouts.values())
    return ModelLayout(params, infos, buffers, writes_params=writes.pop(), sharded=sharded)


def _replicated_layout(module: nn.Module) -> ModelLayout:
    params, infos = [], {}
    for fqn, param in module.named_parameters():
        params.append(LocalParam(param, [Segment(fqn, 0, 0, param.numel())]))
        infos[fqn] = {
            "shape": list(param.shape),
            "dtype": dtype_name(param.dtype),
            "requires_grad": param.requires_grad,
        }
    return ModelLayout(
        params, infos, persistent_buffers(module), writes_params=comm.get_rank() == 0, sharded=False
    )


def persistent_buffers(module: nn.Module) -> Dict[str, torch.Tensor]:
    """Buffers that belong in a state dict (BatchNorm statistics...), by clean name."""
    out = {}
    for prefix, sub in module.named_modules():
        for name in persistent_buffer_names(sub):
            out[clean_name(f"{prefix}.{name}" if prefix else name)] = getattr(sub, name)
    return out


def flat_view(tensor: torch.Tensor) -> torch.Tensor:
    """1-D view sharing storage (parameters and optimizer state are contiguous)."""
    if not tensor.is_contiguous():
        raise ValueError("checkpointing needs contiguous parameters and optimizer state")
    return tensor.detach().view(-1)


def check_matches(meta: dict, infos: Dict[str, dict], buffers: Dict[str, torch.Tensor], path: str) -> None:
    """One-line CheckpointError naming the first parameter or buffer that differs from the model."""
    saved = meta["params"]
    for fqn, info in infos.items():
        if fqn not in saved:
            raise CheckpointError(
                f"{path}: the model's parameter {fqn!r} is not in the checkpoint "
                f"(a checkpoint of another model? it holds e.g. {next(iter(saved), None)!r})"
            )
        if list(saved[fqn]["shape"]) != list(info["shape"]):
            raise CheckpointError(
                f"{path}: {fqn} has shape {tuple(saved[fqn]['shape'])} in the checkpoint "
                f"but {tuple(info['shape'])} in the model"
            )
    unexpected = [fqn for fqn in saved if fqn not in infos]
    if unexpected:
        raise CheckpointError(f"{path}: parameter {unexpected[0]!r} of the checkpoint is not in the model")
    for name, buf in buffers.items():
        if name not in meta["buffers"]:
            raise CheckpointError(f"{path}: the model's buffer {name!r} is not in the checkpoint")
        if list(meta["buffers"][name]["shape"]) != list(buf.shape):
            raise CheckpointError(
                f"{path}: buffer {name} has shape {tuple(meta['buffers'][name]['shape'])} "
                f"in the checkpoint but {tuple(buf.shape)} in the model"
            )
