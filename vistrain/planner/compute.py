"""Seconds of compute in one training step of a rank, measured on this machine unit by unit.

The step time the planner predicts (``traffic.predicted_step_seconds``) adds the link's time to
the compute's, so the compute must be known in seconds. The model of the config is never built
whole: a forward on the meta device records the input shape of every unit of the block-level
wrap policy (every trunk block, a RegNet's stem, each head MLP, the head's fp32 units: what holds nearly all
of the arithmetic) at every call; then each unit alone is created for real (random weights),
run forward and backward twice on a random input of that shape, and the second run is timed.
The sum is a step's forward and backward without communication; at most one unit's weights and
activations exist at a time, so it runs for models that do not fit a rank whole.
"""

import copy
import time
from typing import Callable, List, Optional, Sequence, Tuple

import torch
from torch import nn

from vistrain.models.units import unit_classes
from vistrain.planner.shape import RunShape, meta_crops
from vistrain.torch_compat import BatchNormBase


def unit_calls(
    model: nn.Module,
    crops: List[torch.Tensor],
    head_units: Sequence[type] = (),
    masking: Optional[Callable] = None,
) -> List[Tuple[nn.Module, torch.Size]]:
    """``(unit, input shape)`` of every outermost unit call of one forward of ``model`` (meta);
    ``head_units``: the head's fp32 unit classes (``ModelShapes.head_units``); ``masking``: the
    method's (``ModelShapes.masking``), whose masks decide what a masked-image head scores."""
    classes = tuple(unit_classes(False, "block", head_units, model))
    calls, depth = [], [0]

    def enter(module, args):
        if depth[0] == 0:
            calls.append((module, args[0].shape))
        depth[0] += 1

    def leave(module, args, output):
        depth[0] -= 1

    hooks = []
    for module in model.modules():
        if isinstance(module, classes):
            hooks += [module.register_forward_pre_hook(enter), module.register_forward_hook(leave)]
    try:
        with torch.no_grad():
            model(crops, **(masking(crops) if masking is not None else {}))
    finally:
        for hook in hooks:
            hook.remove()
    return calls


def time_unit(meta_unit: nn.Module, shape: torch.Size, device: torch.device, first: bool) -> float:
    """Seconds of one forward and backward of a real copy of ``meta_unit`` on a random input
    (``first``: the model's input, which needs no gradient); the second of two runs."""
    unit = copy.deepcopy(meta_unit).to_empty(device=device)
    with torch.no_grad():
        for param in unit.parameters():
            param.normal_(0.0, 0.02)
        for module in unit.modules():
            if isinstance(module, BatchNormBase):
                module.reset_running_stats()
    x = torch.randn(shape, device=device, requires_grad=not first)
    seconds = 0.0
    for _ in range(2):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        out = unit(x)
        out = out[0] if isinstance(out, (tuple, list)) else out
        out.float().sum().backward()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        seconds = time.perf_counter() - start
    return seconds


def compute_seconds(shape: RunShape, device: torch.device) -> float:
    """Seconds of one step's forward and backward on one rank of ``shape`` (its batch per rank and
    crops) on ``device`` with this process's threads, measured unit by unit."""
    crops = meta_crops(shape.crops, shape.batch, shape.model.channels)
    calls = unit_calls(shape.model.model, crops, shape.model.head_units, shape.model.masking)
    return sum(time_unit(unit, shape, device, first=i == 0) for i, (unit, shape) in enumerate(calls))
