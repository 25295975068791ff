"""``.safetensors`` files, read and written one tensor at a time.

The format (https://github.com/huggingface/safetensors): 8 bytes, the little-endian length ``n`` of
a JSON header; ``n`` bytes of header, ``{name: {"dtype": "F32", "shape": [...], "data_offsets":
[begin, end]}, "__metadata__": {str: str}}`` (space-padded here to a multiple of 8); then every
tensor's bytes, row-major and little-endian, at ``data_offsets`` counted from the header's end.

Reading uses the ``safetensors`` package (an optional extra: ``pip install -e ".[safetensors]"``):
``safe_open`` reads the header, then one tensor's bytes per :meth:`SafetensorsFile.read`.
Writing (:func:`save_safetensors_streamed`) needs no package: the header is computed from the
shapes and dtypes, then each tensor is computed by the caller, written at its offset and dropped;
atomic like ``tensor_file.save_streamed`` (temporary name, fsync, rename).
"""

import json
import math
import struct
import sys
from collections import OrderedDict
from typing import Callable, Dict, Optional, Tuple

import torch

from vistrain.checkpoint.files import CheckpointError, atomic_file
from vistrain.checkpoint.tensor_file import announced_value, bytes_of

SUFFIX = ".safetensors"
INSTALL = 'pip install -e ".[safetensors]"'
# the format's dtype names (float8 types where this torch has them)
DTYPES = {
    name: getattr(torch, attr)
    for name, attr in (
        ("F64", "float64"), ("F32", "float32"), ("F16", "float16"), ("BF16", "bfloat16"),
        ("I64", "int64"), ("I32", "int32"), ("I16", "int16"), ("I8", "int8"), ("U8", "uint8"),
        ("BOOL", "bool"), ("F8_E4M3", "float8_e4m3fn"), ("F8_E5M2", "float8_e5m2"),
    )
    if hasattr(torch, attr)
}  # fmt: skip
NAMES = {dtype: name for name, dtype in DTYPES.items()}

Specs = Dict[str, Tuple[Tuple[int, ...], torch.dtype]]  # key -> (shape, dtype), in order


def is_safetensors(path: str) -> bool:
    return path.endswith(SUFFIX)


class SafetensorsFile:
    """A ``.safetensors`` file's names, shapes and dtypes (its header) and reads of one tensor.
    CheckpointError (one line) when the package is missing or the file is not readable."""

    def __init__(self, path: str):
        self.path = path
        self._open = _safe_open()
        try:
            with self._open(path, framework="pt") as f:
                slices = [(key, f.get_slice(key)) for key in f.keys()]  # noqa: SIM118  (no __iter__)
                header = [(key, tuple(s.get_shape()), s.get_dtype()) for key, s in slices]
        except Exception as error:  # safetensors' SafetensorError derives from Exception alone
            reason = str(error).splitlines()[0] if str(error) else type(error).__name__
            raise CheckpointError(f"{path}: corrupt or truncated safetensors file ({reason})") from None
        self._specs = OrderedDict((key, (shape, self._dtype(key, name))) for key, shape, name in header)
        if not self._specs:
            raise CheckpointError(f"{path}: holds no tensor")

    def specs(self) -> Specs:
        """key -> (shape, dtype), in the order the package lists them."""
        return OrderedDict(self._specs)

    def read(self, key: str) -> torch.Tensor:
        """A tensor of its own: only its bytes are read."""
        with self._open(self.path, framework="pt") as f:
            return f.get_tensor(key)

    def _dtype(self, key: str, name: str) -> torch.dtype:
        if name not in DTYPES:
            raise CheckpointError(f"{self.path}: tensor {key!r} has dtype {name}, which torch cannot hold")
        return DTYPES[name]


def _safe_open():
    try:
        from safetensors import safe_open
    except ImportError:
        raise CheckpointError(f"reading {SUFFIX} files needs the safetensors package: {INSTALL}") from None
    return safe_open


def save_safetensors_streamed(
    path: str,
    specs: Specs,
    value_of: Callable[[str], torch.Tensor],
    metadata: Optional[Dict[str, str]] = None,
) -> None:
    """Write ``{key: value_of(key)}`` for the keys of ``specs`` (key -> (shape, dtype)) to ``path``
    as a ``.safetensors`` file, holding one value at a time; ``metadata``: the header's
    ``__metadata__`` (strings). Atomic (temporary name, fsync, rename)."""
    if sys.byteorder != "little":
        raise NotImplementedError("writing safetensors files on a big-endian machine")
    header, offset = {}, 0
    for key, (shape, dtype) in specs.items():
        if dtype not in NAMES:
            raise ValueError(f"{key}: dtype {dtype} has no safetensors name")
        size = math.prod(shape) * torch.empty(0, dtype=dtype).element_size()
        header[key] = {"dtype": NAMES[dtype], "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    header["__metadata__"] = dict(metadata or {"format": "pt"})
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # the data starts 8-byte aligned
    with atomic_file(path) as tmp, open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text)
        for key, (shape, dtype) in specs.items():
            value = announced_value(value_of, key, shape, dtype)
            f.write(bytes_of(value.detach().cpu().contiguous()))
            del value
