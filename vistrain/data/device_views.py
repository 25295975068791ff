"""Views made on the run's device (``DATA.<split>.VIEWS_ON_DEVICE``): the loader's workers decode the
images and draw each view's random numbers (the transform's ``prepare``, as on the CPU path); the
batch of prepared samples moves to the device as one buffer per dtype (uint8 pixels, float32
draws), and the transform makes the views there, in the rank's process, before the batch is yielded.

With ``DECODE_ON_DEVICE`` the JPEGs are decoded there too, before the views
(``vistrain/data/device_decode.py``).

The views are the CPU path's: the same code on the same draws, so a function of (seed, epoch,
index) on any device; only floating point differs between devices (and the 8-bit resize of the
crops, which other devices than a CPU compute in float and round: a grey level apart at a few pixels). Nothing changes for the trainer:
the loader yields ``{"crops": [...], "label", "index", "num_skipped"}`` with the crops already on
the device (``MODEL.CHANNELS_LAST`` is applied by the trainer, as to any batch).
"""

from typing import Any, Dict, List, Sequence, Tuple

import torch
from torch.utils.data import get_worker_info

from vistrain.data.collate import collate_fields
from vistrain.data.device_decode import decode_into, take_jpegs
from vistrain.data.workers import WorkerLoader


def flatten(tree: Any, leaves: List[torch.Tensor]) -> Any:
    """``tree`` (dicts, lists and tuples of tensors and plain values) with each tensor replaced by
    its index in ``leaves`` (appended to it) wrapped as ``("tensor", i)``."""
    if isinstance(tree, torch.Tensor):
        leaves.append(tree)
        return ("tensor", len(leaves) - 1)
    if isinstance(tree, dict):
        return {key: flatten(value, leaves) for key, value in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(flatten(value, leaves) for value in tree)
    return tree


def unflatten(spec: Any, leaves: Sequence[torch.Tensor]) -> Any:
    """The inverse of :func:`flatten`."""
    if isinstance(spec, tuple) and len(spec) == 2 and spec[0] == "tensor":
        return leaves[spec[1]]
    if isinstance(spec, dict):
        return {key: unflatten(value, leaves) for key, value in spec.items()}
    if isinstance(spec, (list, tuple)):
        return type(spec)(unflatten(value, leaves) for value in spec)
    return spec


def pack(prepared: Sequence[dict]) -> Dict[str, Any]:
    """The prepared samples of a batch as ``{"spec", "shapes", "buffers"}``: every tensor flattened
    into one contiguous buffer per dtype (in shared memory in a loader worker, so the batch crosses
    to the rank without another copy), ``shapes[i]`` = (dtype name, offset, shape) of tensor i."""
    leaves: List[torch.Tensor] = []
    spec = flatten(list(prepared), leaves)
    groups: Dict[torch.dtype, List[int]] = {}
    for i, leaf in enumerate(leaves):
        groups.setdefault(leaf.dtype, []).append(i)
    shapes: List[Tuple[str, int, Tuple[int, ...]]] = [None] * len(leaves)
    buffers = {}
    for dtype, members in groups.items():
        name = str(dtype).replace("torch.", "")
        total = sum(leaves[i].numel() for i in members)
        buffer = torch.empty(total, dtype=dtype)
        if get_worker_info() is not None:
            buffer.share_memory_()
        offset = 0
        for i in members:
            size = leaves[i].numel()
            buffer[offset : offset + size].view(leaves[i].shape).copy_(leaves[i])
            shapes[i] = (name, offset, tuple(leaves[i].shape))
            offset += size
        buffers[name] = buffer
    return {"spec": spec, "shapes": shapes, "buffers": buffers}


def unpack(packed: Dict[str, Any], device: torch.device) -> List[dict]:
    """The prepared samples of :func:`pack` on ``device``: one copy per buffer, each tensor a view of it."""
    buffers = {name: b.to(device, non_blocking=True) for name, b in packed["buffers"].items()}
    leaves = [
        buffers[name][offset : offset + _numel(shape)].view(shape) for name, offset, shape in packed["shapes"]
    ]
    return unflatten(packed["spec"], leaves)


def _numel(shape: Sequence[int]) -> int:
    count = 1
    for side in shape:
        count *= side
    return count


def collate_packed(samples: List[dict]) -> Dict[str, Any]:
    """The loader worker's half: B samples (see ``SSLDataset``) -> ``{"packed": pack(their prepared
    parts), "jpegs": their JPEGs left encoded (``device_decode.take_jpegs``, None: none), "label",
    "index", "num_skipped"}`` (no views yet)."""
    if not samples:
        raise ValueError("collate_packed got an empty batch")
    prepared = [dict(s["prepared"]) for s in samples]
    jpegs = take_jpegs(prepared)
    return {"packed": pack(prepared), "jpegs": jpegs, **collate_fields(samples)}


def make_views(batch: Dict[str, Any], dataset, device: torch.device) -> Dict[str, Any]:
    """The rank's half: a :func:`collate_packed` batch of ``dataset`` -> the ``collate_multicrop``
    batch, its ``"crops"`` (List[Tensor (B, 3, h, w) float32]) made on ``device`` by the dataset's
    transform, its JPEGs left encoded decoded there first (``device_decode.decode_into``)."""
    out = {key: value for key, value in batch.items() if key not in ("packed", "jpegs")}
    transform = dataset.transform
    with torch.no_grad():
        prepared = unpack(batch["packed"], device)
        if batch.get("jpegs") is not None:
            place = lambda p: unpack(pack([p]), device)[0]
            decode_into(prepared, batch["jpegs"], device, out, transform.scale, dataset.sample, place)
        out["crops"] = transform(prepared)
    return out


class DeviceViewsLoader(WorkerLoader):
    """A DataLoader whose workers collate with :func:`collate_packed` and whose iterator makes
    each batch's views on ``device`` (:func:`make_views`); sampler, length and epochs as DataLoader's."""

    def __init__(self, dataset, device: torch.device, **kwargs):
        super().__init__(dataset, collate_fn=collate_packed, **kwargs)
        self.device = torch.device(device)

    def __iter__(self):
        for batch in super().__iter__():
            yield make_views(batch, self.dataset, self.device)
