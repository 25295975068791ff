"""Keeping ranks in agreement: the first step's unit-order check.

Sharded units exchange weights and gradients in collectives matched by issue order, so every
rank must run the same units in the same order. Two same-size units run in a rank-dependent
order would silently swap weights; a unit run on some ranks only would leave peers waiting.
During the first training step every unit call is therefore announced to all ranks (an
all-gather of ``(call number, unit index)``, 16 bytes per rank), and so is the end of each root
forward; so is the start of each unit's backward and the end of backward, unless
``find_unused_parameters`` defers every backward collective to the end. The first mismatch
raises the same error on every rank, naming what each rank ran, before the mismatched
collective is issued.
"""

import torch
import torch.distributed as dist

from vistrain.fsdp.lifecycle import RootState
from vistrain.fsdp.timeouts import wait_within

END = -1  # announced when a root forward returns / a backward ends


def check_unit_call(state: RootState, group, unit_index: int, backward: bool = False) -> None:
    """Announce this rank's next unit forward (or backward) call, ``END`` when the root forward
    (or the backward) is over; raise on every rank when the ranks disagree. First step only."""
    world = dist.get_world_size(group)
    if state.order_checked or world == 1:
        return
    device = state.root.compute_device
    calls = state.backward_calls if backward else state.calls_this_step
    mine = torch.tensor([calls, unit_index], dtype=torch.long, device=device)
    gathered = [torch.empty_like(mine) for _ in range(world)]
    work = dist.all_gather(gathered, mine, group=group, async_op=True)
    wait_within(work, state.root.collective_timeout, "the first step's unit-order check", device)
    if backward:
        state.backward_calls += 1
    else:
        state.calls_this_step += 1
    seen = [int(t[1]) for t in gathered]
    if len(set(seen)) > 1:
        ran = ", ".join(f"rank {r} ran {_describe(state, i, backward)}" for r, i in enumerate(seen))
        what = "the backward of different units" if backward else "different units"
        hint = (
            "an output that reaches the loss on some ranks only needs find_unused_parameters=True"
            if backward
            else "sharded units must run in the same order on every rank (no rank-dependent "
            "branches or order)"
        )
        raise RuntimeError(
            f"FullyShardedDataParallel: ranks ran {what} in the first training step; at unit call "
            f"{calls}: {ran}. {hint[0].upper()}{hint[1:]}"
        )


def record_call(unit) -> None:
    """A unit's training forward begins: note the execution order (prefetches follow it)."""
    state = unit._root_state
    if not state.exec_order_final and unit not in state.exec_order:
        state.exec_order.append(unit)
    check_unit_call(state, state.root.process_group, state.units.index(unit))


def check_backward_call(state: RootState, unit_index: int) -> None:
    """A unit's backward begins (``END``: the backward ends). Not needed, and skipped, when
    ``find_unused_parameters`` defers every backward collective or gradients are not synced."""
    if not state.root.find_unused_parameters and state.require_grad_sync:
        check_unit_call(state, state.root.process_group, unit_index, backward=True)


def _describe(state: RootState, index: int, backward: bool) -> str:
    if index == END:
        return (
            "nothing (its backward had finished)" if backward else "nothing (its root forward had returned)"
        )
    return f"'{state.name(state.units[index])}'"
