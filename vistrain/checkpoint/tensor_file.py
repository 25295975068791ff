"""``torch.save`` files read and written one tensor at a time, never whole.

Reading (:class:`TensorFile`): ``torch.load(f, map_location="meta", weights_only=True)`` gives the
file's structure, every tensor as a meta tensor of its shape and dtype, without reading any
tensor data; torch records where each storage's bytes start inside the zip
(:func:`vistrain.torch_compat.storage_file_offset`). A read then copies exactly the bytes of
one tensor, or of a range of its elements, with plain file reads into the caller's tensor.
Nothing is memory-mapped, so nothing of the file stays in the process once the copy is done
(the OS page cache may keep the bytes; it drops them when memory is needed). A file in torch's
legacy (non-zip) format, or written with the other byte order, has no usable offsets: it is
loaded whole, with a warning.

Writing (:func:`save_streamed`): ``torch.save`` under ``torch.serialization.skip_data`` writes the
zip (the pickled structure, the records' headers) with the space of every tensor left empty,
from placeholders that are allocated but never touched; each tensor is then computed by the
caller, written at its offset and dropped before the next one. The file is fsync'd under a
temporary name and renamed, so ``path`` is either the old file or the complete new one. Plain
``torch.load(path, weights_only=True)`` reads it like any other; only the zip CRC32 fields of the
tensor records stay 0 (as with ``torch.serialization.set_crc32_options(False)``), which torch
does not check but ``unzip -t`` reports.
"""

import logging
import sys
import zipfile
from typing import Callable, Dict, Tuple

import torch

from vistrain.checkpoint.files import CheckpointError, atomic_file, load_structure, safe_load
from vistrain.torch_compat import storage_file_offset, tree_flatten, tree_map

logger = logging.getLogger("vistrain")


class TensorFile:
    """One ``torch.save`` file: its structure (``.obj``, meta tensors) and reads of its tensors."""

    def __init__(self, path: str):
        self.path = path
        self.obj = load_structure(path)
        self.streamed = _native_zip(path) and _has_offsets(self.obj)
        if not self.streamed:
            logger.warning(f"{path}: legacy or foreign-byte-order torch file, loaded whole")
            self.obj = safe_load(path, mmap=False)

    def tensor(self, t: torch.Tensor) -> torch.Tensor:
        """A new tensor with the values of ``t`` (an entry of ``.obj``): its shape and dtype."""
        if not self.streamed:
            return t.clone()
        if not t.is_contiguous():
            return self._strided(t)
        out = torch.empty(t.shape, dtype=t.dtype)
        self.read_into(t, 0, out.view(-1))
        return out

    def read_into(self, t: torch.Tensor, start: int, out: torch.Tensor) -> None:
        """Copy elements ``[start, start + out.numel())`` of the flattened ``t`` into the 1-D
        contiguous ``out`` (converted to ``out.dtype``); only those bytes are read."""
        count = out.numel()
        if start < 0 or start + count > t.numel():
            raise CheckpointError(
                f"{self.path}: elements {start}..{start + count} of a {t.numel()}-element tensor"
            )
        if not self.streamed or not t.is_contiguous():
            whole = self._strided(t) if self.streamed else t
            out.copy_(whole.reshape(-1)[start : start + count])
            return
        target = out if out.dtype == t.dtype else torch.empty(count, dtype=t.dtype)
        offset = storage_file_offset(t.untyped_storage()) + (t.storage_offset() + start) * t.element_size()
        self._read_bytes(offset, target)
        if target is not out:
            out.copy_(target)

    def materialize(self, tree):
        """``tree`` (part of ``.obj``) with every tensor replaced by its values."""
        return tree_map(lambda v: self.tensor(v) if isinstance(v, torch.Tensor) else v, tree)

    def _strided(self, t: torch.Tensor) -> torch.Tensor:
        # a view saved with its larger storage: read the storage, then take the view
        storage = torch.empty(t.untyped_storage().nbytes(), dtype=torch.uint8)
        self._read_bytes(storage_file_offset(t.untyped_storage()), storage)
        view = torch.empty(0, dtype=t.dtype).set_(
            storage.untyped_storage(), t.storage_offset(), t.shape, t.stride()
        )
        return view.clone()

    def _read_bytes(self, offset: int, out: torch.Tensor) -> None:
        buffer = bytes_of(out)
        with open(self.path, "rb", buffering=0) as f:
            f.seek(offset)
            done = 0
            while done < len(buffer):
                n = f.readinto(buffer[done:])
                if not n:
                    raise CheckpointError(
                        f"{self.path}: truncated (tensor data ends at byte {offset + done})"
                    )
                done += n


def bytes_of(t: torch.Tensor) -> memoryview:
    """Writable bytes of the contiguous tensor ``t`` (any dtype, also bfloat16)."""
    if not t.is_contiguous():
        raise ValueError("reading or writing the bytes of a tensor needs a contiguous one")
    flat = t.detach().view(-1)
    if flat.numel() == 0:
        return memoryview(bytearray())
    return memoryview(flat.view(torch.uint8).numpy()).cast("B")


def _has_offsets(obj) -> bool:
    tensors = [v for v in tree_flatten(obj)[0] if isinstance(v, torch.Tensor)]
    return all(storage_file_offset(t.untyped_storage()) is not None for t in tensors)


def _native_zip(path: str) -> bool:
    """A zip (not legacy) torch file whose tensors are in this machine's byte order."""
    if not zipfile.is_zipfile(path):
        return False
    with zipfile.ZipFile(path) as archive:
        for name in archive.namelist():
            if name.endswith("/byteorder"):
                return archive.read(name).decode().strip() == sys.byteorder
    return True  # files without the record are read as native by torch too


def save_streamed(
    path: str, specs: Dict[str, Tuple[Tuple[int, ...], torch.dtype]], value_of: Callable[[str], torch.Tensor]
) -> None:
    """Write ``{key: value_of(key)}`` for the keys of ``specs`` (key -> (shape, dtype)) to ``path``
    as one ``torch.save`` file, holding one value at a time. Atomic (temporary name, fsync, rename)."""
    with atomic_file(path) as tmp:
        _write_layout(tmp, specs)
        layout = load_structure(tmp)
        with open(tmp, "r+b", buffering=0) as f:
            for key, spec in layout.items():
                value = announced_value(value_of, key, spec.shape, spec.dtype)
                f.seek(storage_file_offset(spec.untyped_storage()))
                f.write(bytes_of(value.contiguous()))
                del value


def announced_value(value_of: Callable[[str], torch.Tensor], key: str, shape, dtype) -> torch.Tensor:
    """``value_of(key)``; ValueError unless it has the announced ``shape`` and ``dtype``."""
    value = value_of(key)
    if tuple(value.shape) != tuple(shape) or value.dtype != dtype:
        raise ValueError(f"{key}: got {value.dtype}{tuple(value.shape)}, announced {dtype}{tuple(shape)}")
    return value


def _write_layout(tmp: str, specs: Dict[str, Tuple[Tuple[int, ...], torch.dtype]]) -> None:
    # torch.empty reserves address space only: skip_data never reads the placeholders, so their
    # pages are never touched (the OS backs them when first written, which never happens)
    # (unless deterministic mode fills new memory: switched off meanwhile)
    fill = torch.utils.deterministic.fill_uninitialized_memory
    torch.utils.deterministic.fill_uninitialized_memory = False
    try:
        placeholders = {key: torch.empty(shape, dtype=dtype) for key, (shape, dtype) in specs.items()}
    finally:
        torch.utils.deterministic.fill_uninitialized_memory = fill
    with open(tmp, "wb") as f, torch.serialization.skip_data():
        torch.save(placeholders, f)
