"""The training phases of a sharded unit and of a wrapped model, and which changes are legal.

A unit (``UnitState``)::

    IDLE --training forward--> FORWARD --forward returns--> IDLE
    IDLE --pre-backward gather--> BACKWARD --end of backward--> IDLE
    IDLE --summon_full_params--> SUMMONED --block exits--> IDLE
    IDLE --local state dict--> LOCAL --block exits--> IDLE

A wrapped model (``ModelState``) moves only through IDLE, FORWARD (inside the root's training
forward) and BACKWARD (first backward hook of a step to autograd's final callback).

After an exception any phase may return to IDLE, but only through the owners' recovery methods,
which say so (``recovering=True``). Anything else is a bug of the engine and raises.
"""

import enum


class Phase(enum.Enum):
    IDLE = "idle"
    FORWARD = "forward"
    BACKWARD = "backward"
    SUMMONED = "summoned"  # full parameters exposed by summon_full_params
    LOCAL = "local"  # state_dict()/load_state_dict() deal in this rank's shards


UNIT_TRANSITIONS = frozenset(
    {
        (Phase.IDLE, Phase.FORWARD),
        (Phase.FORWARD, Phase.IDLE),
        (Phase.IDLE, Phase.BACKWARD),
        (Phase.BACKWARD, Phase.IDLE),
        (Phase.IDLE, Phase.SUMMONED),
        (Phase.SUMMONED, Phase.IDLE),
        (Phase.IDLE, Phase.LOCAL),
        (Phase.LOCAL, Phase.IDLE),
    }
)

MODEL_TRANSITIONS = frozenset(
    {
        (Phase.IDLE, Phase.FORWARD),
        (Phase.FORWARD, Phase.IDLE),
        (Phase.IDLE, Phase.BACKWARD),
        (Phase.BACKWARD, Phase.IDLE),
    }
)


def checked_transition(legal: frozenset, current: Phase, target: Phase, what: str, recovering: bool) -> Phase:
    """``target`` if moving there from ``current`` is legal, else raise naming ``what``."""
    if (current, target) in legal or (recovering and target is Phase.IDLE):
        return target
    raise RuntimeError(
        f"FullyShardedDataParallel internal error: {what} cannot go from {current.value} to {target.value}"
    )
