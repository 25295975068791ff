"""The units' execution order, and the first step's check that every rank runs the same one.

Sharded units exchange weights and gradients in collectives matched by issue order, so every
rank must run the same units in the same order. Two same-size units run in a rank-dependent
order would silently swap weights; a unit run on some ranks only would leave peers waiting.
During the first training step every unit call is therefore announced to all ranks (an
all-gather of ``(call number, unit index)``, 16 bytes per rank), and so is the end of each root
forward; so is the start of each unit's backward and the end of backward, unless
``find_unused_parameters`` defers every backward collective to the end. The first mismatch
raises the same error on every rank, naming what each rank ran, before the mismatched
collective is issued.

With hybrid sharding the check runs over the shard group and then over the replica group, so
it covers every rank of the world (replicas exchange gradients in issue order too).

The execution order recorded in the first step also tells prefetches which unit runs next.
"""

import datetime
from typing import Callable, List, Sequence

import torch
import torch.distributed as dist

from vistrain.fsdp.collectives import wait_within

END = -1  # announced when a root forward returns / a backward ends


class UnitOrder:
    """The order in which one wrapped model's units run, and the first step's check of it.

    ``names[i]`` is the path of unit ``i`` (outermost first, the canonical order); ``groups``
    the process groups that must agree (the shard group, and the replica group when hybrid).
    """

    def __init__(self, names: List[str], groups: Sequence, device: torch.device, timeout: datetime.timedelta):
        self.names = names
        self.groups = list(groups)
        self.device = device
        self.timeout = timeout
        self.execution: List[int] = []  # unit indices in first-forward-call order
        self.final = False  # fixed after the first completed backward
        self.checked = False  # the first step's cross-rank check has passed
        self.forward_calls = 0  # within the current root forward
        self.backward_calls = 0  # within the current backward

    # -- forward --------------------------------------------------------------------------------
    def begin_forward(self) -> None:
        self.forward_calls = 0

    def record_forward(self, index: int) -> None:
        """Unit ``index``'s training forward begins: note the order, check it in the first step."""
        if not self.final and index not in self.execution:
            self.execution.append(index)
        self._check(index, backward=False)

    def end_forward(self) -> None:
        self._check(END, backward=False)

    # -- backward -------------------------------------------------------------------------------
    def begin_backward(self) -> None:
        self.backward_calls = 0

    def record_backward(self, index: int) -> None:
        self._check(index, backward=True)

    def end_backward(self, announce: bool) -> None:
        """A backward is over (``announce``: tell the other ranks, as each unit's start was):
        from now on the order is fixed and has been checked."""
        if announce:
            self._check(END, backward=True)
        self.final = bool(self.execution)
        self.checked = True

    def neighbours(self, index: int, step: int, depth: int) -> List[int]:
        """Units that run after unit ``index`` (``step`` +1 in forward, -1 in backward), up to
        ``depth`` of them; none until the order is fixed."""
        if not self.final or index not in self.execution:
            return []
        at = self.execution.index(index)
        ahead = [at + d * step for d in range(1, depth + 1)]
        return [self.execution[j] for j in ahead if 0 <= j < len(self.execution)]

    # -- the check --------------------------------------------------------------------------------
    def _check(self, index: int, backward: bool) -> None:
        """Announce this rank's next unit call (or ``END``); raise on every rank when the ranks
        disagree. First step only."""
        if self.checked:
            return
        calls = self.backward_calls if backward else self.forward_calls
        if backward:
            self.backward_calls += 1
        else:
            self.forward_calls += 1
        for group in self.groups:
            world = dist.get_world_size(group)
            if world == 1:
                continue
            mine = torch.tensor([calls, index], dtype=torch.long, device=self.device)
            gathered = [torch.empty_like(mine) for _ in range(world)]
            work = dist.all_gather(gathered, mine, group=group, async_op=True)
            wait_within(work, self.timeout, "the first step's unit-order check", self.device)
            seen = [int(t[1]) for t in gathered]
            if len(set(seen)) > 1:
                ranks = dist.get_process_group_ranks(group)
                raise RuntimeError(_disagreement(ranks, seen, calls, backward, self._describe))

    def _describe(self, index: int, backward: bool) -> str:
        if index == END:
            return (
                "nothing (its backward had finished)"
                if backward
                else "nothing (its root forward had returned)"
            )
        return f"'{self.names[index]}'"


def _disagreement(ranks: List[int], seen: List[int], calls: int, backward: bool, describe: Callable) -> str:
    ran = ", ".join(f"rank {r} ran {describe(i, backward)}" for r, i in zip(ranks, seen))
    what = "the backward of different units" if backward else "different units"
    hint = (
        "an output that reaches the loss on some ranks only needs find_unused_parameters=True"
        if backward
        else "sharded units must run in the same order on every rank (no rank-dependent branches or order)"
    )
    return (
        f"FullyShardedDataParallel: ranks ran {what} in the first training step; at unit call "
        f"{calls}: {ran}. {hint[0].upper()}{hint[1:]}"
    )
