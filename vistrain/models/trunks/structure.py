"""A library model's repeated blocks, found from its structure (never from its name).

The trunk families that adopt another library's models (``timm_models``, ``torchvision_models``)
cannot list their block classes: any of thousands of models may come. The rule:

* a *candidate* is a class of which two or more instances are children of an ``nn.Sequential``
  or ``nn.ModuleList`` (one or several: a stage of one block counts), each instance holding
  parameters in submodules of its own (a composite: a ``Linear`` or ``Conv2d`` is a layer, not a
  block); plain ``nn.Sequential`` / ``nn.ModuleList`` are containers, never blocks. A model with
  no container holding one (blocks as named attributes: timm's RegNet) looks at the children of
  every module instead;
* ``"block"`` units: the candidates whose instances contain no other candidate's (the innermost
  repeated blocks: timm's ``ConvNeXtBlock``, ViT ``Block``, EfficientNet ``InvertedResidual``,
  torchvision's ``CNBlock``, ``SwinTransformerBlock``, ``Conv2dNormActivation`` inside a
  MobileNetV3 ``InvertedResidual``);
* ``"stage"`` units: the candidates no other candidate's instance contains (the outermost: timm's
  ``ConvNeXtStage``, torchvision's MobileNetV3 ``InvertedResidual``; a ViT's blocks).

A family's config may instead name the classes (``BLOCKS``): :func:`classes_named`.
"""

import difflib
from collections import Counter
from typing import Dict, Iterable, List, Sequence, Tuple, Type

from torch import nn

CONTAINERS = (nn.Sequential, nn.ModuleList)


def is_composite(module: nn.Module) -> bool:
    """Whether ``module`` holds parameters in a submodule of its own (a block, not a layer)."""
    return any(any(True for _ in child.parameters()) for child in module.children())


def candidate_classes(root: nn.Module) -> List[Type[nn.Module]]:
    """Classes with two or more composite instances that are children of containers, in the
    order first met; a model without containers (blocks as named attributes, timm's RegNet):
    children of any module."""
    for parents in (CONTAINERS, nn.Module):
        counts = Counter(
            type(child)
            for parent in root.modules()
            if isinstance(parent, parents)
            for child in parent.children()
            if type(child) not in (nn.Sequential, nn.ModuleList) and is_composite(child)
        )
        found = [cls for cls, n in counts.items() if n >= 2]
        if found:
            return found
    return []


def _contains(root: nn.Module, outer: Type[nn.Module], inner: Type[nn.Module]) -> bool:
    """Whether some instance of ``outer`` in ``root`` has an instance of ``inner`` below it."""
    return any(
        isinstance(sub, inner) and sub is not module
        for module in root.modules()
        if isinstance(module, outer)
        for sub in module.modules()
    )


def repeated_blocks(root: nn.Module) -> Dict[str, Tuple[Type[nn.Module], ...]]:
    """``{"block": innermost candidates, "stage": outermost candidates}`` of ``root`` (both
    empty for a model with no repeated blocks)."""
    candidates = candidate_classes(root)
    inside = {
        (outer, inner)
        for outer in candidates
        for inner in candidates
        if outer is not inner and _contains(root, outer, inner)
    }
    blocks = tuple(c for c in candidates if not any((c, other) in inside for other in candidates))
    stages = tuple(c for c in candidates if not any((other, c) in inside for other in candidates))
    return {"block": blocks, "stage": stages}


def classes_named(root: nn.Module, names: Sequence[str], key: str) -> Tuple[Type[nn.Module], ...]:
    """The classes of ``root``'s modules called ``names``; ValueError (one line, naming ``key``
    and the closest composite classes of the model) for a name no module has."""
    by_name: Dict[str, Type[nn.Module]] = {}
    for module in root.modules():
        by_name.setdefault(type(module).__name__, type(module))
    missing = [n for n in names if n not in by_name]
    if missing:
        composite = sorted({type(m).__name__ for m in root.modules() if is_composite(m)})
        close = difflib.get_close_matches(missing[0], composite, n=5, cutoff=0.3) or composite[:8]
        raise ValueError(
            f"{key}: the model has no module of class {missing[0]!r}; its blocks' classes include "
            f"{', '.join(close)}"
        )
    return tuple(by_name[n] for n in names)


def describe_units(root: nn.Module, classes: Iterable[Type[nn.Module]]) -> str:
    """``"ConvNeXtBlock x 18, ..."``: each class and how many of ``root``'s modules are one."""
    counts = Counter(type(m) for m in root.modules())
    return ", ".join(f"{cls.__name__} x {counts[cls]}" for cls in classes) or "none"
