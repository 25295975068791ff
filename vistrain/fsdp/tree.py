"""Walk the tensors inside module inputs and outputs, whatever the container.

Handles tensors, tuples, namedtuples, lists, dicts (their subclasses keep their type when they
can be built from items) and dataclass instances; anything else is a leaf left as it is.
"""

import dataclasses
from typing import Any, Callable, Iterator

import torch


def map_tensors(obj: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """A copy of ``obj`` with every tensor ``t`` replaced by ``fn(t)``; containers rebuilt."""
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # namedtuple: positional constructor
        return type(obj)(*(map_tensors(item, fn) for item in obj))
    if isinstance(obj, (tuple, list)):
        return type(obj)(map_tensors(item, fn) for item in obj)
    if isinstance(obj, dict):
        mapped = {key: map_tensors(value, fn) for key, value in obj.items()}
        return mapped if type(obj) is dict else type(obj)(mapped)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        changes = {f.name: map_tensors(getattr(obj, f.name), fn) for f in dataclasses.fields(obj) if f.init}
        return dataclasses.replace(obj, **changes)
    return obj


def iter_tensors(obj: Any) -> Iterator[torch.Tensor]:
    """Every tensor inside ``obj``, depth first, in container order."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (tuple, list)):
        for item in obj:
            yield from iter_tensors(item)
    elif isinstance(obj, dict):
        for item in obj.values():
            yield from iter_tensors(item)
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for f in dataclasses.fields(obj):
            yield from iter_tensors(getattr(obj, f.name))
