"""Warm-ups that would outlast a short run take half of it instead (one note says so).

A recipe's warm-ups are sized for its full length: the quick start warms its lr up over 0.5 of 40
epochs, the DINO demos their lr over 5 and the teacher temperature over 10, the SwAV demo freezes
its prototypes for its first epoch's 22 iterations. A trial run of one epoch would never leave
them (the lr schedule refused it outright; the prototypes would never train). So before anything
starts, every warm-up (:data:`WARMUPS` and the run's method's, which the methods layer hands
over, as it does its keys) that does not end before the run does is set to half the
run (``num_epochs / 2``; whole epochs or iterations for integer keys, rounded down), and the
command prints one line naming each change; ``config.yaml`` records the values the run used.
Longer runs are not touched.
"""

from typing import List, NamedTuple, Optional, Sequence, Tuple

from fvcore.common.config import CfgNode

from vistrain.config.checks import get_key


class Warmup(NamedTuple):
    """A config key that is a warm-up's length: in ``unit`` (epochs | iterations); the warm-up
    outlasts the run when ``value - slack >= the run's length`` in that unit."""

    key: str  # dotted (a method's record names it within its section: ``vistrain.methods``)
    unit: str
    slack: int = 0


# the lr's linear ramp; the main schedule (cosine...) starts where it ends. The methods add theirs
# (``Method.warmups``: DINO's teacher temperature and last-layer freeze, SwAV's prototype freeze).
WARMUPS: Tuple[Warmup, ...] = (Warmup("OPTIMIZER.param_schedulers.lr.warmup_epochs", "epochs"),)


def fit_warmups(
    cfg: CfgNode, more: Sequence[Warmup] = (), iters_per_epoch: Optional[int] = None
) -> Tuple[CfgNode, Optional[str]]:
    """``(cfg, None)`` when every warm-up (:data:`WARMUPS` and ``more``: the run's method's) ends
    before the run does; else a copy of ``cfg`` (frozen like it) with those that do not at half
    the run, and the one-line note naming them. Warm-ups counted in iterations are fitted only
    when ``iters_per_epoch`` (the run's) is given."""
    length = {"epochs": cfg.OPTIMIZER.num_epochs}
    if iters_per_epoch:
        length["iterations"] = cfg.OPTIMIZER.num_epochs * iters_per_epoch
    changes: List[Tuple[str, object, object]] = []
    for key, unit, slack in (*WARMUPS, *more):
        if unit not in length:
            continue
        value = get_key(cfg, key)
        if value > 0 and value - slack >= length[unit]:
            half = length[unit] // 2 if isinstance(value, int) else length[unit] / 2
            changes.append((key, value, half))
    if not changes:
        return cfg, None
    fitted = cfg.clone()
    fitted.defrost()
    for key, _, half in changes:
        *sections, name = key.split(".")
        node = fitted
        for section in sections:
            node = node[section]
        node[name] = half
    fitted.freeze()
    shown = ", ".join(f"{key} {old} -> {new}" for key, old, new in changes)
    note = (
        f"short run: warm-ups that would outlast the {cfg.OPTIMIZER.num_epochs}-epoch run take half of it: "
        f"{shown} (config.yaml records them)"
    )
    return fitted, note
