"""Checkpoints of ``TorchShardedModel`` (PyTorch's ``fully_shard``, DTensor parameters).

The same on-disk format, through ``torch.distributed.checkpoint.state_dict``: saving gathers
full (``full_state_dict=True``, CPU-offloaded) model and optimizer state dicts, and rank 0 writes
every parameter as one whole slice (as for DDP). Loading gives every rank the full tensors read
from the rank files and lets ``set_model_state_dict`` / ``set_optimizer_state_dict`` re-shard
them. This costs one full copy of the model (and of its optimizer state) in CPU memory per rank;
our own engine (``BACKEND=builtin``) has no such peak.
"""

from typing import Dict, List

import torch

from vistrain.checkpoint.layout import check_matches, dtype_name
from vistrain.fsdp import Backend, backend_of


def is_torch_sharded(model) -> bool:
    return backend_of(model) is Backend.TORCH


def _options(**kwargs):
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(**kwargs)


def _infos(module) -> Dict[str, dict]:
    # DTensor parameters report the full (global) shape
    return {
        fqn: {"shape": list(p.shape), "dtype": dtype_name(p.dtype), "requires_grad": p.requires_grad}
        for fqn, p in module.named_parameters()
    }


def full_states(model, optimizer):
    """(param slices, optimizer slices, buffers, infos): full on rank 0, empty elsewhere. Collective."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    module = model.module
    infos = _infos(module)
    full = get_model_state_dict(module, options=_options(full_state_dict=True, cpu_offload=True))
    params = {fqn: {"start": 0, "values": full[fqn].reshape(-1)} for fqn in infos if fqn in full}
    buffers = {k: v for k, v in full.items() if k not in infos}
    optim = {"tensors": {}, "scalars": {}}
    if optimizer is not None:
        osd = get_optimizer_state_dict(
            module, optimizer, options=_options(full_state_dict=True, cpu_offload=True)
        )
        for fqn, state in osd.get("state", {}).items():
            for key, value in state.items():
                if torch.is_tensor(value) and value.dim() > 0 and list(value.shape) == infos[fqn]["shape"]:
                    optim["tensors"].setdefault(key, {})[fqn] = {"start": 0, "values": value.reshape(-1)}
                else:
                    optim["scalars"].setdefault(fqn, {})[key] = value
    return params, optim, buffers, infos


def group_fqns(model, optimizer) -> List[List[str]]:
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    osd = get_optimizer_state_dict(model.module, optimizer)
    return [list(group["params"]) for group in osd["param_groups"]]


def load_full_states(model, optimizer, reader) -> None:
    """Every rank reads the full tensors; torch re-shards them. Collective."""
    from torch.distributed.checkpoint.state_dict import (
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    module = model.module
    infos = _infos(module)
    buffers = {k: v for k, v in module.state_dict().items() if k not in infos}
    check_matches(reader.meta, infos, buffers, reader.path)
    full = {fqn: reader.read_param(fqn) for fqn in infos}
    full.update({name: reader.read_buffer(name) for name in buffers})
    set_model_state_dict(module, full, options=_options(full_state_dict=True))
    del full
    if optimizer is None:
        return
    groups = get_optimizer_state_dict(module, optimizer)["param_groups"]
    state = {}
    for fqn, info in infos.items():
        entry = {}
        for key in reader.meta["optimizer"]["tensor_state"]:
            flat = torch.zeros(torch.Size(info["shape"]).numel(), dtype=getattr(torch, info["dtype"]))
            if reader.fill(fqn, 0, flat, key):
                entry[key] = flat.view(info["shape"])
        scalars = reader.scalars(fqn) or {}
        entry.update({k: v.clone() if torch.is_tensor(v) else v for k, v in scalars.items()})
        if entry:
            state[fqn] = entry
    set_optimizer_state_dict(
        module, optimizer, {"state": state, "param_groups": groups}, options=_options(full_state_dict=True)
    )
