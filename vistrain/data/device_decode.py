"""JPEGs decoded on the run's device (``DATA.<split>.DECODE_ON_DEVICE``), a batch at a time.

The loader's workers read each JPEG's header, not its data (``folders.EncodedJpeg``: the JPEGs
that the CPU path decodes by torchvision.io at full size), and draw the views' random numbers from
its size, as the CPU path draws them from the decoded image's (``MultiCropTransform.draw``): the
same generator, seeded by (seed, epoch, index), the same draws. The batch's JPEG bytes cross to the
rank in one buffer (:func:`take_jpegs`); the rank decodes them with
``torchvision.io.decode_jpeg(list, device=...)`` (nvjpeg, batched, on a GPU; libjpeg-turbo on a
CPU, the CPU path's decoder) and the views are made from those pixels (:func:`decode_into`).

Other images (PNG, TIFF, arrays, JPEGs decoded at reduced size, CMYK...) are decoded in the
workers as before. A JPEG the device refuses is decoded again on the rank's CPU, as the CPU path
decodes it (:meth:`SSLDataset.sample` with ``redo``): an image the CPU decodes gives the CPU path's
sample; an unreadable one stops the run or, with SKIP_CORRUPT, is replaced by the next readable
image with the same draws, label, index and skip count as the CPU path's.
"""

from typing import Any, Callable, Dict, List, Optional, Sequence

import torch
from torch.utils.data import get_worker_info
from torchvision.io import ImageReadMode, decode_jpeg

_READ_MODES = {"RGB": ImageReadMode.RGB, "L": ImageReadMode.GRAY}


def take_jpegs(prepared: List[dict]) -> Optional[Dict[str, Any]]:
    """The worker's half: remove each ``"jpeg"`` (an ``EncodedJpeg``) from the prepared samples
    that hold one -> ``{"bytes": uint8 (total,) (in shared memory in a worker), "spans": [(sample,
    offset, length, mode, shape, name)]}``; None when the batch holds none."""
    held = [(i, p.pop("jpeg")) for i, p in enumerate(prepared) if "jpeg" in p]
    if not held:
        return None
    buffer = torch.empty(sum(jpeg.data.numel() for _, jpeg in held), dtype=torch.uint8)
    if get_worker_info() is not None:
        buffer.share_memory_()
    spans, offset = [], 0
    for i, jpeg in held:
        buffer[offset : offset + jpeg.data.numel()].copy_(jpeg.data)
        spans.append((i, offset, jpeg.data.numel(), jpeg.mode, tuple(jpeg.shape), jpeg.name))
        offset += jpeg.data.numel()
    return {"bytes": buffer, "spans": spans}


def decode_jpegs(
    data: Sequence[torch.Tensor], modes: Sequence[str], device: torch.device
) -> List[Optional[torch.Tensor]]:
    """JPEG bytes (uint8 (n,) on the CPU each) -> uint8 (C, H, W) on ``device`` each (C = 3 for
    mode "RGB", 1 for "L"), one ``decode_jpeg`` call per mode; None for each that the decoder
    refuses (a batch call that fails is retried one image at a time to find them)."""
    out: List[Optional[torch.Tensor]] = [None] * len(data)
    for mode in sorted(set(modes)):
        members = [i for i, m in enumerate(modes) if m == mode]
        try:
            images = decode_jpeg([data[i] for i in members], mode=_READ_MODES[mode], device=device)
        except RuntimeError:  # the batch call gives nothing when one image fails
            images = [_decode_one(data[i], mode, device) for i in members]
        for i, image in zip(members, images):
            out[i] = image
    return out


def _decode_one(data: torch.Tensor, mode: str, device: torch.device) -> Optional[torch.Tensor]:
    try:
        return decode_jpeg(data, mode=_READ_MODES[mode], device=device)
    except RuntimeError:
        return None


def decode_into(
    prepared: List[dict],
    jpegs: Dict[str, Any],
    device: torch.device,
    fields: Dict[str, Any],
    scale: Callable[[torch.Tensor], torch.Tensor],
    redo: Callable[..., dict],
    place: Callable[[dict], dict],
) -> None:
    """The rank's half: decode the batch's JPEGs on ``device`` and set each one's ``"pixels"``
    (``scale``: the transform's, uint8 -> as ``prepare`` holds them) in ``prepared`` (the batch's
    prepared samples on the device). A JPEG refused, or decoded to another shape than its header
    said, is replaced by ``redo(index, epoch, redo=skipped)`` (``SSLDataset.sample``: the CPU
    path's sample), moved by ``place``; ``fields`` (``"label"``, ``"index"``, ``"num_skipped"``)
    take the replacement's."""
    spans = jpegs["spans"]
    data = [jpegs["bytes"][offset : offset + length] for _, offset, length, *_ in spans]
    decoded = decode_jpegs(data, [mode for _, _, _, mode, _, _ in spans], device)
    for (i, _, _, _, shape, _), pixels in zip(spans, decoded):
        if pixels is not None and tuple(pixels.shape) == tuple(shape):  # pinning may make lists
            prepared[i]["pixels"] = scale(pixels)
            continue
        index, epoch, skipped = prepared[i]["redo"]
        sample = redo(index, epoch, redo=skipped)
        prepared[i] = place(sample["prepared"])
        fields["label"][i], fields["index"][i] = sample["label"], sample["index"]
        fields["num_skipped"] += sample["skipped"] - skipped
