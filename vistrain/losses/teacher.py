"""A momentum teacher: a second copy of the network, updated as a moving average of the student.

The teacher model is built by the run (same builder, same wrap policy as the student; see
``vistrain.runtime.teacher``); this object owns it and the momentum schedule, and is asked by the
loop for two things only::

    targets = teacher(teacher_crops, **masking)  # no_grad, train mode (batch statistics, as DINO/BYOL)
    teacher.update(student, iteration)      # after the optimizer step: t = m t + (1 - m) s
"""

import math

import torch
from torch import nn

from vistrain.fsdp import foreach_ema_, paired_tensors


def cosine_momentum(start: float, iteration: int, total_iterations: int) -> float:
    """DINO / BYOL: ``m = 1 - (1 - m0) (cos(pi k / K) + 1) / 2`` at step k of K: m0 -> 1."""
    if total_iterations <= 0:
        return start
    progress = min(max(iteration / total_iterations, 0.0), 1.0)
    return 1.0 - (1.0 - start) * (math.cos(math.pi * progress) + 1.0) / 2.0


class MomentumTeacher:
    """``model``: the teacher (sharded, or a plain module under DDP runs), parameters without
    gradients; ``start_momentum``: m0; ``total_iterations``: K of the cosine schedule."""

    def __init__(self, model: nn.Module, start_momentum: float, total_iterations: int):
        self.model = model
        self.start_momentum = start_momentum
        self.total_iterations = total_iterations
        self._pairs = None  # (teacher tensors, student tensors), paired and checked at the first update

    def __call__(self, crops, **masking):
        """The teacher's output for ``crops`` (``masking``: the criterion's ``teacher_masking()``);
        no graph, weights resharded after each unit."""
        with torch.no_grad():
            return self.model(crops, **masking)

    def momentum(self, iteration: int) -> float:
        return cosine_momentum(self.start_momentum, iteration, self.total_iterations)

    def update(self, student: nn.Module, iteration: int) -> None:
        """The EMA after the optimizer step of (0-based) ``iteration``: one foreach update of the
        local shards (``vistrain.fsdp.foreach_ema_``), no communication."""
        if self._pairs is None:
            self._pairs = paired_tensors(self.model, student)
        foreach_ema_(*self._pairs, self.momentum(iteration))
