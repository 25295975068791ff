"""The momentum teacher's update, one engine operation: ``t = m t + (1 - m) s`` over local storage.

A teacher built by the same builder and wrapped by the same policy as its student has the same
units, the same flat handles and the same shard layout, so the exponential moving average is an
elementwise update of each rank's flat shards: no gather, no communication (dinov2's
``_foreach_mul_`` / ``_foreach_add_`` over FSDP flat parameters; VISSL's zip of local shards).

    ema_update_(teacher, student, momentum)   # after optimizer.step(); teacher has no gradients

or, pairing (and checking) once for a run, ``foreach_ema_(*paired_tensors(teacher, student), m)``.

Models of the built-in engine pair their units' ``FlatParamHandle.shard`` tensors (whatever
``parameters()`` yields); ``fully_shard`` models pair their DTensors' local shards; a plain module
or DDP pairs ``parameters()`` of the unwrapped modules. A layout mismatch is one line naming the
first difference. Buffers (BatchNorm statistics) are not averaged: as in DINO and BYOL the teacher's
own forward passes update them.
"""

from typing import List, Tuple

import torch
from torch import nn

from vistrain.fsdp.backends import Backend, backend_of, unwrap
from vistrain.fsdp.ownership import clean_name

Pairs = Tuple[List[torch.Tensor], List[torch.Tensor]]


class LayoutMismatchError(ValueError):
    """The teacher and the student do not hold the same local tensors."""


@torch.no_grad()
def ema_update_(teacher: nn.Module, student: nn.Module, momentum: float) -> None:
    """``t = momentum * t + (1 - momentum) * s`` for every local tensor of ``teacher``, in place.

    Two foreach kernels over all of this rank's tensors (fp32 shards: the same arithmetic, element
    by element, as ``t.mul_(m).add_(s, alpha=1 - m)`` on whole parameters). ``momentum`` 0 copies
    the student exactly. Raises :class:`LayoutMismatchError` when the two models are distributed
    differently (built or wrapped by different configs).
    """
    foreach_ema_(*paired_tensors(teacher, student), momentum)


@torch.no_grad()
def foreach_ema_(targets: List[torch.Tensor], sources: List[torch.Tensor], momentum: float) -> None:
    """``t = momentum * t + (1 - momentum) * s`` over lists from :func:`paired_tensors`."""
    if not 0.0 <= momentum <= 1.0:
        raise ValueError(f"the teacher's momentum must lie in [0, 1], got {momentum}")
    if targets:
        torch._foreach_mul_(targets, momentum)
        torch._foreach_add_(targets, sources, alpha=1.0 - momentum)


def paired_tensors(teacher: nn.Module, student: nn.Module) -> Pairs:
    """(teacher tensors, student tensors) this rank updates, in the same order; checks the layout.
    The tensors are the storage itself (detached aliases): valid for the models' lifetime."""
    backend = backend_of(student)
    if backend_of(teacher) is not backend:
        raise LayoutMismatchError(
            f"the teacher is distributed as {backend_of(teacher).value}, the student as {backend.value}"
        )
    if backend is Backend.BUILTIN:
        return _shard_pairs(teacher, student)
    if backend is Backend.TORCH:
        return _named_pairs(teacher.module, student.module, local=True)
    return _named_pairs(unwrap(teacher), unwrap(student), local=False)


def _shard_pairs(teacher, student) -> Pairs:
    t_units, s_units = teacher.units(), student.units()
    if len(t_units) != len(s_units):
        raise LayoutMismatchError(f"the teacher has {len(t_units)} sharded units, the student {len(s_units)}")
    targets, sources = [], []
    for t_unit, s_unit in zip(t_units, s_units):
        t_handles, s_handles = t_unit.unit_state.handles, s_unit.unit_state.handles
        if len(t_handles) != len(s_handles):
            raise LayoutMismatchError(
                f"unit {t_unit.unit_state.describe()}: {len(t_handles)} flat handles in the teacher, "
                f"{len(s_handles)} in the student"
            )
        for t_handle, s_handle in zip(t_handles, s_handles):
            t_names = [(o.fqn, tuple(o.shape)) for o in t_handle.origins]
            s_names = [(o.fqn, tuple(o.shape)) for o in s_handle.origins]
            t, s = t_handle.shard, s_handle.shard
            if t_names != s_names or t.shape != s.shape or t.dtype != s.dtype:
                raise LayoutMismatchError(
                    f"the teacher's shard of {t_handle.describe()} ({tuple(t.shape)}, {t.dtype}) does not "
                    f"match the student's shard of {s_handle.describe()} ({tuple(s.shape)}, {s.dtype})"
                )
            targets.append(t.detach())
            sources.append(s.detach())
    return targets, sources


def _named_pairs(teacher: nn.Module, student: nn.Module, local: bool) -> Pairs:
    t_params = [(clean_name(n), p) for n, p in teacher.named_parameters()]
    s_params = [(clean_name(n), p) for n, p in student.named_parameters()]
    if [n for n, _ in t_params] != [n for n, _ in s_params]:
        missing = sorted({n for n, _ in s_params} ^ {n for n, _ in t_params})
        raise LayoutMismatchError(
            f"the teacher's parameters differ from the student's (first difference: {missing[:1] or 'order'})"
        )
    targets, sources = [], []
    for (name, t), (_, s) in zip(t_params, s_params):
        t, s = (t.to_local(), s.to_local()) if local else (t, s)
        if t.shape != s.shape or t.dtype != s.dtype:
            raise LayoutMismatchError(
                f"{name}: {tuple(t.shape)} {t.dtype} in the teacher, {tuple(s.shape)} {s.dtype} in the student"
            )
        targets.append(t.detach())
        sources.append(s.detach())
    return targets, sources
