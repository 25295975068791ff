"""Sharded save (format: vistrain.checkpoint): every rank writes the original-parameter slices it
owns, in parallel; nothing is gathered through rank 0 except a small description of what each rank
wrote, from which rank 0 writes ``metadata.json`` last (see :func:`save_sharded_checkpoint`)."""

import os
import shutil
import time
from typing import Callable, Dict, List, Optional

import torch

import vistrain
from vistrain.checkpoint import torch_backend
from vistrain.checkpoint.files import (
    FORMAT,
    METADATA,
    TMP_SUFFIX,
    CheckpointError,
    checkpoint_name,
    prune,
    publish,
    rank_file,
    save_file,
    write_json,
)
from vistrain.checkpoint.layout import ModelLayout, dtype_name, flat_view, model_layout
from vistrain.checkpoint.rng import capture_rng
from vistrain.distributed import comm


def save_sharded_checkpoint(
    run_dir: str, iteration: int, model, optimizer, extra: dict, metadata: dict, keep_last: int
) -> str:
    """Write ``run_dir/checkpoint_<iteration>/``; collective (every rank calls it). Returns the path.

    Args:
        model: our sharded engine, DDP, a plain module, or a ``TorchShardedModel``; or a mapping
            of name prefixes to models distributed alike (``{"": student, "teacher.": teacher}``,
            not with ``TorchShardedModel``), whose fqns the prefixes lead.
        optimizer: built on ``model.parameters()`` (None: weights only).
        extra: this rank's extra state (anything ``weights_only`` can load).
        metadata: JSON-able entries added to metadata.json (epoch, position, config...).
        keep_last: complete checkpoints kept afterwards (<= 0: all).
    Raises CheckpointError on every rank when any rank failed to write (e.g. a full disk); the
    previous checkpoints are then untouched and the partial folder ends in ``.tmp``.
    """
    final = os.path.join(run_dir, checkpoint_name(iteration))
    return write_sharded_checkpoint(
        final, iteration, model, optimizer, extra, metadata, on_published=lambda: prune(run_dir, keep_last)
    )


def write_sharded_checkpoint(
    path: str,
    iteration: int,
    model,
    optimizer,
    extra: dict,
    metadata: dict,
    on_published: Optional[Callable[[], None]] = None,
) -> str:
    """Write the checkpoint folder ``path`` (any name: Lightning's ``epoch=3-step=40.ckpt``);
    collective. Arguments and errors as :func:`save_sharded_checkpoint`, which names the folder
    after the iteration; ``on_published`` runs on rank 0 once the folder has its final name."""
    rank = comm.get_rank()
    tmp = path + TMP_SUFFIX
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)  # left by an interrupted save
        os.makedirs(tmp)
    comm.barrier()
    error, report = None, {}
    try:
        payload, report = _rank_payload(model, optimizer, extra)
        save_file(payload, rank_file(tmp, rank))
        del payload
    except Exception as exc:  # a full disk on one rank must not leave the others waiting
        error = f"rank {rank}: {type(exc).__name__}: {exc}"
    reports = _all_succeeded(error, path, comm.all_gather_object((error, report)))
    error = None
    if rank == 0:
        try:
            meta = _metadata(reports, iteration, optimizer, metadata)
            write_json(meta, os.path.join(tmp, METADATA))  # last: the checkpoint is now complete
            publish(tmp, path)
            if on_published is not None:
                on_published()
        except Exception as exc:
            error = f"rank 0: {type(exc).__name__}: {exc}"
    _all_succeeded(error, path, comm.all_gather_object((error, None)))
    return path


def _all_succeeded(error: Optional[str], final: str, gathered: List) -> List:
    errors = [e for e, _ in gathered if e]
    if errors:
        raise CheckpointError(f"saving {final} failed ({errors[0]}); earlier checkpoints are kept")
    return [r for _, r in gathered]


def _rank_payload(model, optimizer, extra: dict):
    """(this rank's file contents, the description of it that metadata.json needs)."""
    if torch_backend.is_torch_sharded(model):
        params, optim, buffers, infos = torch_backend.full_states(model, optimizer)
        groups = torch_backend.group_fqns(model, optimizer) if optimizer is not None else None
    else:
        layout = model_layout(model)
        params = _param_slices(layout) if layout.writes_params else {}
        optim = _optimizer_slices(layout, optimizer) if layout.writes_params else _no_optimizer()
        buffers = layout.buffers if comm.get_rank() == 0 else {}
        infos, groups = layout.infos, _group_fqns(layout, optimizer)
    payload = {
        "format": FORMAT,
        "rank": comm.get_rank(),
        "world_size": comm.get_world_size(),
        "params": params,
        "optimizer": optim,
        "buffers": {name: _copy(buf) for name, buf in buffers.items()},
        "rng": capture_rng(),
        "extra": extra,
    }
    report = {
        "infos": infos,
        "slices": {fqn: [entry["start"], entry["values"].numel()] for fqn, entry in params.items()},
        "buffers": {
            name: {"shape": list(b.shape), "dtype": dtype_name(b.dtype)} for name, b in buffers.items()
        },
        "tensor_state": sorted(optim["tensors"]),
        "scalar_state": sorted({key for state in optim["scalars"].values() for key in state}),
        "groups": groups if params else None,
    }
    return payload, report


def _copy(tensor: torch.Tensor) -> torch.Tensor:
    # a view would make torch.save write its whole storage (the entire shard); copy to CPU
    return tensor.detach().to("cpu", copy=True)


def _param_slices(layout: ModelLayout) -> Dict[str, dict]:
    out = {}
    for local in layout.params:
        flat = flat_view(local.tensor)
        for seg in local.segments:
            out[seg.fqn] = {"start": seg.start, "values": _copy(flat[seg.offset : seg.offset + seg.length])}
    return out


def _no_optimizer() -> dict:
    return {"tensors": {}, "scalars": {}}


def _optimizer_slices(layout: ModelLayout, optimizer) -> dict:
    """Per original parameter: slices of every state tensor shaped like the param, and scalars."""
    out = _no_optimizer()
    if optimizer is None:
        return out
    by_tensor = {id(local.tensor): local for local in layout.params}
    for group in optimizer.param_groups:
        for param in group["params"]:
            local = by_tensor.get(id(param))
            if local is None:
                raise RuntimeError("the optimizer holds a tensor that is not a parameter of the model")
            for key, value in optimizer.state.get(param, {}).items():
                if torch.is_tensor(value) and value.dim() > 0 and value.shape == param.shape:
                    flat = flat_view(value)
                    slices = out["tensors"].setdefault(key, {})
                    for seg in local.segments:
                        slices[seg.fqn] = {
                            "start": seg.start,
                            "values": _copy(flat[seg.offset : seg.offset + seg.length]),
                        }
                else:  # "step" and other per-shard scalars: recorded for every fqn of the shard
                    value = _copy(value) if torch.is_tensor(value) else value
                    for seg in local.segments:
                        out["scalars"].setdefault(seg.fqn, {})[key] = value
    return out


def _group_fqns(layout: ModelLayout, optimizer) -> Optional[List[List[str]]]:
    """For each optimizer param group: the fqns it holds on this rank."""
    if optimizer is None:
        return None
    by_tensor = {id(local.tensor): local for local in layout.params}
    return [
        [seg.fqn for p in group["params"] for seg in by_tensor[id(p)].segments]
        for group in optimizer.param_groups
    ]


def _metadata(reports: List[dict], iteration: int, optimizer, extra_meta: dict) -> dict:
    world = len(reports)
    params = {fqn: dict(info, slices=[]) for fqn, info in reports[0]["infos"].items()}
    buffers = {}
    for rank, report in enumerate(reports):
        for fqn, (start, length) in report["slices"].items():
            params[fqn]["slices"].append([rank, start, length])
        buffers.update(report["buffers"])
    return {
        "format": FORMAT,
        "vistrain_version": vistrain.__version__,
        "torch_version": torch.__version__,
        "created": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "iteration": iteration,
        "world_size": world,
        "rank_files": [os.path.basename(rank_file("", r)) for r in range(world)],
        "params": params,
        "buffers": buffers,
        "optimizer": _optimizer_meta(reports, optimizer),
        **extra_meta,
    }


def _optimizer_meta(reports: List[dict], optimizer) -> Optional[dict]:
    if optimizer is None:
        return None
    groups = []
    for g, group in enumerate(optimizer.param_groups):
        fqns = []
        for report in reports:
            if report["groups"] is not None:
                fqns += [f for f in report["groups"][g] if f not in fqns]
        hyper = {k: _jsonable(v) for k, v in group.items() if k != "params"}
        groups.append(dict(hyper, params=fqns))
    return {
        "class": type(optimizer).__name__,
        "tensor_state": sorted({k for r in reports for k in r["tensor_state"]}),
        "scalar_state": sorted({k for r in reports for k in r["scalar_state"]}),
        "param_groups": groups,
    }


def _jsonable(value):
    if isinstance(value, (bool, int, float, str)) or value is None:
        return value
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if torch.is_tensor(value) and value.numel() == 1:
        return value.item()
    return repr(value)
