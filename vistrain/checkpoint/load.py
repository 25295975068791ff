"""Sharded load on any world size: each rank copies only the slices it needs.

For every range ``[start, start + length)`` of an original parameter that this rank holds (its
shard's segments under the sharded engine, the whole parameter under DDP), the metadata says
which rank files of the saving job overlap it; only the bytes of the overlapping elements are
read from them, straight into this rank's tensor (``tensor_file.TensorFile``: no file is mapped
or loaded whole, so nothing but the destination grows while a rank loads).
Optimizer state is rebuilt the same way, per state key, then handed to
``optimizer.load_state_dict`` in exactly the structure the optimizer itself produces, so
momentum, Adam moments and step counts continue as if nothing happened.
"""

import logging
from typing import Dict, Optional

import torch

from vistrain.checkpoint import torch_backend
from vistrain.checkpoint.files import CheckpointError, rank_file, read_metadata
from vistrain.checkpoint.layout import LocalParam, ModelLayout, check_matches, flat_view, model_layout
from vistrain.checkpoint.tensor_file import TensorFile
from vistrain.distributed import comm

logger = logging.getLogger("vistrain")


class SliceReader:
    """Reads ranges of original parameters (or of their optimizer state) out of the rank files."""

    def __init__(self, path: str, metadata: Optional[dict] = None):
        self.path = path
        self.meta = metadata if metadata is not None else read_metadata(path)
        self._files: Dict[int, TensorFile] = {}

    def tensor_file(self, rank: int) -> TensorFile:
        """``rank<rank>.pt``, its structure read once (no tensor data)."""
        if rank not in self._files:
            self._files[rank] = TensorFile(rank_file(self.path, rank))
        return self._files[rank]

    def file(self, rank: int) -> dict:
        """The structure of ``rank<rank>.pt``: its tensors are meta tensors (shape and dtype)."""
        return self.tensor_file(rank).obj

    def values(self, rank: int, tree):
        """``tree`` (part of :meth:`file`) with the tensors read from ``rank<rank>.pt``."""
        return self.tensor_file(rank).materialize(tree)

    def fill(self, fqn: str, start: int, out: torch.Tensor, state_key: Optional[str] = None) -> int:
        """Copy elements ``[start, start + out.numel())`` of parameter ``fqn`` (or of its optimizer
        state ``state_key``) into the 1-D ``out``. Returns how many elements some rank file held."""
        found, end = 0, start + out.numel()
        for rank, s_start, s_len in self.meta["params"][fqn]["slices"]:
            lo, hi = max(start, s_start), min(end, s_start + s_len)
            if lo >= hi:
                continue
            entry = self._entry(rank, fqn, state_key)
            if entry is None:  # no optimizer state for this parameter (frozen, or never stepped)
                continue
            values = entry["values"]
            if entry["start"] != s_start or values.numel() != s_len:
                raise CheckpointError(
                    f"{rank_file(self.path, rank)}: slice of {fqn} does not match metadata.json"
                )
            self.tensor_file(rank).read_into(values, lo - s_start, out[lo - start : hi - start])
            found += hi - lo
        return found

    def _entry(self, rank: int, fqn: str, state_key: Optional[str]):
        data = self.file(rank)
        try:
            if state_key is None:
                return data["params"][fqn]
            return data["optimizer"]["tensors"].get(state_key, {}).get(fqn)
        except (KeyError, TypeError):
            raise CheckpointError(
                f"{rank_file(self.path, rank)}: holds no slice of {fqn} although metadata.json says so"
            ) from None

    def read_param(self, fqn: str) -> torch.Tensor:
        """The whole original parameter ``fqn`` as a new tensor of its shape and dtype."""
        info = self.meta["params"][fqn]
        out = torch.empty(info["shape"], dtype=getattr(torch, info["dtype"]))
        if self.fill(fqn, 0, out.view(-1)) != out.numel():
            raise CheckpointError(f"{self.path}: the rank files do not cover all of {fqn}")
        return out

    def read_buffer(self, name: str) -> torch.Tensor:
        return self.tensor_file(0).tensor(self.file(0)["buffers"][name])

    def scalars(self, fqn: str) -> Optional[dict]:
        """Per-shard optimizer scalars (e.g. ``step``) recorded for ``fqn`` (first writer's)."""
        for rank, _, _ in self.meta["params"][fqn]["slices"]:
            found = self.file(rank)["optimizer"]["scalars"].get(fqn)
            if found is not None:
                return self.values(rank, found)
        return None


def load_sharded_checkpoint(path: str, model, optimizer=None) -> dict:
    """Load weights, buffers and (when given) optimizer state of ``path`` into this rank's model.

    Works on any world size and any wrapper (sharded engine, DDP, plain, ``TorchShardedModel``);
    ``model`` may be a mapping of name prefixes to models, as for the save.
    Returns ``{"metadata", "same_world_size", "extra", "rng"}``: ``extra``/``rng`` are this rank's
    when the world size is unchanged, else rank 0's extra and no RNG state.
    """
    reader = SliceReader(path)
    meta = reader.meta
    if torch_backend.is_torch_sharded(model):
        torch_backend.load_full_states(model, optimizer, reader)
    else:
        layout = model_layout(model)
        check_matches(meta, layout.infos, layout.buffers, path)
        _load_params(layout, reader)
        if optimizer is not None:
            load_optimizer_state(optimizer, layout, reader)
    same = meta["world_size"] == comm.get_world_size()
    mine = comm.get_rank() if same else 0
    return {
        "metadata": meta,
        "same_world_size": same,
        "extra": reader.values(mine, reader.file(mine)["extra"]),
        "rng": reader.values(mine, reader.file(mine)["rng"]) if same else None,
    }


@torch.no_grad()
def _load_params(layout: ModelLayout, reader: SliceReader) -> None:
    for local in layout.params:
        flat = flat_view(local.tensor)
        flat.zero_()  # the padding of the last shard stays zero
        for seg in local.segments:
            if reader.fill(seg.fqn, seg.start, flat[seg.offset : seg.offset + seg.length]) != seg.length:
                raise CheckpointError(f"{reader.path}: the rank files do not cover all of {seg.fqn}")
    for name, buf in layout.buffers.items():
        buf.copy_(reader.read_buffer(name))


def load_optimizer_state(optimizer, layout: ModelLayout, reader: SliceReader) -> None:
    """Rebuild this rank's optimizer state from per-fqn slices and load it."""
    info = reader.meta.get("optimizer")
    if info is None:
        raise CheckpointError(f"{reader.path}: holds no optimizer state")
    if info["class"] != type(optimizer).__name__:
        raise CheckpointError(
            f"{reader.path}: optimizer state of {info['class']}, this run uses {type(optimizer).__name__}"
        )
    by_tensor = {id(local.tensor): local for local in layout.params}
    state, index = {}, 0
    for group in optimizer.param_groups:
        for param in group["params"]:
            entry = _param_state(by_tensor[id(param)], param, reader, info)
            if entry:
                state[index] = entry
            index += 1
    current = optimizer.state_dict()
    optimizer.load_state_dict({"state": state, "param_groups": current["param_groups"]})


def _param_state(local: LocalParam, param: torch.Tensor, reader: SliceReader, info: dict) -> dict:
    entry = {}
    for key in info["tensor_state"]:
        flat = torch.zeros(param.numel(), dtype=param.dtype)
        found = sum(
            reader.fill(seg.fqn, seg.start, flat[seg.offset : seg.offset + seg.length], key)
            for seg in local.segments
        )
        if found:  # parts without saved state (a never-stepped parameter) start from zero
            entry[key] = flat.view(param.shape)
    scalars = [s for s in (reader.scalars(seg.fqn) for seg in local.segments) if s]
    if scalars:
        for key, value in scalars[0].items():
            entry[key] = value.clone() if torch.is_tensor(value) else value
        if any(not _same(s, scalars[0]) for s in scalars[1:]):
            logger.warning(
                f"{reader.path}: parameters sharing a shard had different optimizer "
                f"{sorted(scalars[0])}; using those of {local.segments[0].fqn}"
            )
    return entry


def _same(a: dict, b: dict) -> bool:
    if a.keys() != b.keys():
        return False
    return all(torch.equal(a[k], b[k]) if torch.is_tensor(a[k]) else a[k] == b[k] for k in a)
