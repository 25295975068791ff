"""What a run folder trains, and the one-line refusal of another run there.

A training run's folder holds its checkpoints; each ``metadata.json`` records the config that
saved it and the size of its training set. That is the folder's memory of what it trains, its
**identity**: the data (sources, paths, split, and how many samples they held), the method
(``LOSS.NAME``), the trunk (its family and the family's size section, e.g. ``MODEL.TRUNK.REGNET``)
and the head (``MODEL.HEAD``: the keys its head reads). Everything else may change when a run resumes there: epochs (train
on), the lr and its schedule, batch size, ranks, the exact knobs, augmentations, logging and
checkpoint settings.

A run whose identity differs from the folder's latest checkpoint would mix two runs (resuming the
other's weights on other data) or, started afresh, overwrite its checkpoints. It is refused in
one line naming a free folder beside it (:func:`check_same_run`): by the launcher before any rank
starts, and again by the ranks when they resume (a folder that changed in between, a job started
from Python), before anything is written.
"""

import os
from typing import Dict, List, Optional, Tuple

from vistrain.config.errors import InputError
from vistrain.config.loader import load_yaml
from vistrain.methods import HEADS

Identity = Dict[str, object]

# aspect -> the dotted keys it is made of ("<family>" is the trunk family's own section)
ASPECTS: Dict[str, Tuple[str, ...]] = {
    "data": ("DATA.TRAIN.DATA_SOURCES", "DATA.TRAIN.DATA_PATHS", "DATA.TRAIN.SPLIT"),
    "method": ("LOSS.NAME",),
    "trunk": ("MODEL.TRUNK.NAME", "MODEL.TRUNK.<family>"),
    "head": ("MODEL.HEAD",),
}


# MODEL.HEAD keys every head reads; each head adds its own (``vistrain.methods.Head.keys``)
HEAD_KEYS = ("NAME", "DIMS", "USE_BN")


class OtherRunError(InputError):
    """The run folder holds a run of other data, another method or another model."""

    kind = "run folder taken"


def run_identity(cfg, num_samples: int) -> Identity:
    """``{aspect: value}`` of a training config (a CfgNode or the dict of a saved one) whose
    training set holds ``num_samples``: what a run folder must keep (module docstring)."""
    identity: Identity = {}
    for aspect, keys in ASPECTS.items():
        values = []
        for key in keys:
            if "<family>" in key:
                key = key.replace("<family>", str(_get(cfg, "MODEL.TRUNK.NAME")).upper())
            value = _plain(_get(cfg, key))
            if key == "DATA.TRAIN.DATA_PATHS":  # "./data/x" and "data/x" are one folder
                value = tuple(os.path.normpath(path) if path else path for path in value)
            if key == "MODEL.HEAD":  # the keys the head reads (other heads' keys are not its shape)
                value = {k: v for k, v in value.items() if k in HEAD_KEYS or k in _head_keys(value)}
            values.append(value)
        identity[aspect] = tuple(values)
    identity["samples"] = num_samples
    return identity


def folder_identity(meta: dict) -> Optional[Identity]:
    """The identity a checkpoint's ``metadata.json`` records (None for one without its config)."""
    text = meta.get("config")
    if not isinstance(text, str):
        return None
    try:
        return run_identity(load_yaml(text), meta.get("num_samples"))
    except (KeyError, TypeError, AttributeError):  # written before a key existed: nothing to compare
        return None


def check_same_run(run_dir: str, meta: dict, cfg, num_samples: int, agreed: bool = False) -> None:
    """Raise :class:`OtherRunError` (one line) unless the run of ``cfg`` on ``num_samples``
    training samples is the one whose checkpoint (``meta``: its metadata) ``run_dir`` holds.
    ``agreed``: every rank of a job calls it alike (one reports)."""
    recorded = folder_identity(meta)
    if recorded is None:
        return
    mine = run_identity(cfg, num_samples)
    differs = [aspect for aspect, value in mine.items() if not _same(recorded[aspect], value)]
    if "samples" in differs and meta.get("num_samples") is None:
        differs.remove("samples")
    if not differs:
        return
    raise OtherRunError(
        f"{run_dir} holds checkpoints of {_describe(recorded, mine, differs)}; this run trains "
        f"{_describe(mine, recorded, differs)}; resuming would mix the two and a fresh start would "
        f"overwrite them: give this run its own folder, e.g. config.CHECKPOINT.DIR={free_folder(run_dir)}",
        agreed=agreed,
    )


def free_folder(run_dir: str) -> str:
    """``run_dir`` with the first suffix ``_2``, ``_3``... naming nothing that exists yet."""
    base = run_dir.rstrip("/") or run_dir
    n = 2
    while os.path.exists(f"{base}_{n}"):
        n += 1
    return f"{base}_{n}"


def _describe(identity: Identity, other: Identity, aspects: List[str]) -> str:
    """``identity``'s ``aspects`` in words (what differs from ``other``):
    ``data disk_folder /x (train, 200 samples)``, ``method dino_loss``, ``trunk regnet {DEPTH: 6}``."""
    parts = []
    for aspect in ASPECTS:
        if aspect == "data" and "samples" in aspects or aspect in aspects:
            parts.append(f"{aspect} {_show(aspect, identity, other)}")
    return ", ".join(parts)


def _show(aspect: str, identity: Identity, other: Identity) -> str:
    value = identity[aspect]
    if aspect == "data":
        sources, paths, split = value
        named = " + ".join(f"{s} {p}" if p else s for s, p in zip(sources, list(paths) + [""] * len(sources)))
        samples = identity["samples"]
        return f"{named} ({split}, {samples} samples)" if samples is not None else f"{named} ({split})"
    if aspect == "method":
        return str(value[0])
    if aspect == "trunk":
        (name, family), (other_name, other_family) = value, other[aspect]
        if name != other_name:
            return f"{name} {family.get('NAME', '')}".strip()
        return f"{name} {_differing(family, other_family)}"
    return _differing(value[0], other[aspect][0])


def _same(a, b) -> bool:
    """``a == b``, sections compared on the keys both hold: a key added to vistrain after a run
    saved its checkpoints (its default then in force) is no difference."""
    if isinstance(a, dict) and isinstance(b, dict):
        return all(_same(a[key], b[key]) for key in a.keys() & b.keys())
    if isinstance(a, tuple) and isinstance(b, tuple):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


def _head_keys(head: dict) -> Tuple[str, ...]:
    """The MODEL.HEAD keys the head named in ``head`` adds (``Head.keys``)."""
    registered = HEADS.get(head.get("NAME"))
    return tuple(registered.keys()) if registered is not None else ()


def _differing(section: dict, other: dict) -> str:
    """``{KEY: value, ...}`` of the keys of ``section`` whose value ``other`` holds otherwise."""
    shown = {key: value for key, value in section.items() if key in other and not _same(other[key], value)}
    return "{" + ", ".join(f"{key}: {_text(value)}" for key, value in shown.items()) + "}"


def _text(value) -> str:
    return str(list(value)) if isinstance(value, tuple) else str(value)


def _get(cfg, key: str):
    for part in key.split("."):
        cfg = cfg[part]
    return cfg


def _plain(value):
    """A CfgNode / dict / list as plain, comparable Python values (lists as tuples)."""
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in sorted(value.items())}
    if isinstance(value, (list, tuple)):
        return tuple(_plain(v) for v in value)
    return value
