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

The folder also remembers its **schedule**: how it trains (:data:`SCHEDULE`: the optimizer, its
epochs, lr schedule and warm-up, the augmentations, the method's own settings, the seed; and the
global batch, ranks x ``DATA.TRAIN.BATCHSIZE_PER_REPLICA`` x ``OPTIMIZER.update_freq``). A run
that would resume it under another schedule (a 1-epoch trial, then the recipe in the same folder;
another batch or lr) would quietly train neither, so it is refused alike unless
``CHECKPOINT.ALLOW_OTHER_SCHEDULE`` says to train on from it. The same command resumes silently;
so does a run on another number of ranks with the same global batch, in another precision, with
other exact knobs (sharding, checkpointing...), logging or checkpoint settings.

An evaluation writes its results (metrics.json, pictures, heads, a fine-tuned checkpoint) into
its folder: :func:`check_same_results` refuses a job whose folder's ``config.yaml`` records
another job or evaluation (other weights, label fraction, features...), which it would overwrite.
"""

import os
from typing import Dict, Iterator, List, Optional, Tuple

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


# How a run trains: a checkpoint resumes only under the same values ("<method>": LOSS.NAME's
# section), and the same global batch (_global_batch). OPTIMIZER.step_in_backward is an exact knob
# (the same numbers) and may change; update_freq counts in the global batch.
SCHEDULE: Tuple[str, ...] = ("OPTIMIZER", "DATA.TRAIN.TRANSFORMS", "LOSS.<method>", "SEED_VALUE")
NOT_SCHEDULE: Tuple[str, ...] = ("OPTIMIZER.step_in_backward", "OPTIMIZER.update_freq")

# What an evaluation's results do not depend on: where and how fast it runs, and what it logs
# (every exact knob of vistrain/planner/knobs.py is among them). Everything else is compared.
NOT_RESULTS: Tuple[str, ...] = (
    "MACHINE",
    "DISTRIBUTED",
    "CHECKPOINT",
    "LOG_FREQUENCY",
    "LOGGING",
    "MONITOR",
    "DATA.NUM_DATALOADER_WORKERS",
    "DATA.PIN_MEMORY",
    "DATA.CACHE_DIR",
    "DATA.TEST.BATCHSIZE_PER_REPLICA",  # scored in eval mode, each image once: any batch
    "MODEL.FSDP_CONFIG",
    "MODEL.ACTIVATION_CHECKPOINTING",
    "MODEL.AMP_PARAMS",
    "OPTIMIZER.step_in_backward",
    "BENCHMARK.KNN_CHUNK_SIZE",
)
SHOWN = 3  # differing keys a refusal names


class OtherRunError(InputError):
    """The run folder holds a run of other data, another method or model, another schedule, or
    another evaluation's results."""

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


def check_same_run(
    run_dir: str, meta: dict, cfg, num_samples: int, agreed: bool = False, world_size: Optional[int] = None
) -> None:
    """Raise :class:`OtherRunError` (one line) unless the run of ``cfg`` on ``num_samples``
    training samples is the one whose checkpoint (``meta``: its metadata) ``run_dir`` holds, on
    its schedule (the global batch too when ``world_size``, the run's ranks, is given).
    ``agreed``: every rank of a job calls it alike (one reports)."""
    recorded = folder_identity(meta)
    if recorded is None:
        return
    mine = run_identity(cfg, num_samples)
    differs = [aspect for aspect, value in mine.items() if not _same(recorded[aspect], value)]
    if "samples" in differs and meta.get("num_samples") is None:
        differs.remove("samples")
    if not differs:
        _check_same_schedule(
            run_dir, (load_yaml(meta["config"]), meta.get("world_size")), cfg, (world_size, agreed)
        )
        return
    raise OtherRunError(
        f"{run_dir} holds checkpoints of {_describe(recorded, mine, differs)}; this run trains "
        f"{_describe(mine, recorded, differs)}; resuming would mix the two and a fresh start would "
        f"overwrite them: give this run its own folder, e.g. config.CHECKPOINT.DIR={free_folder(run_dir)}",
        agreed=agreed,
    )


def _check_same_schedule(run_dir: str, saved, cfg, run) -> None:
    """:class:`OtherRunError` (one line) when ``cfg`` trains on another :data:`SCHEDULE` or global
    batch than the folder's checkpoint, unless ``CHECKPOINT.ALLOW_OTHER_SCHEDULE``. ``saved``: (its
    config, its ranks or None); ``run``: (this run's ranks or None, ``agreed``)."""
    (recorded, saved_world), (world_size, agreed) = saved, run
    if cfg.CHECKPOINT.ALLOW_OTHER_SCHEDULE:
        return
    keys = [key.replace("<method>", str(_get(cfg, "LOSS.NAME"))) for key in SCHEDULE]
    differs = differing(recorded, cfg, keys, NOT_SCHEDULE)
    batches = (_global_batch(recorded, saved_world), _global_batch(cfg, world_size))
    if None not in batches and batches[0][0] != batches[1][0]:
        differs.append(("global batch", batches[0][1], batches[1][1]))
    if not differs:
        return
    raise OtherRunError(
        f"{run_dir} holds checkpoints trained with {_values(differs, 0)}; this run asks for "
        f"{_values(differs, 1)}: resuming would continue that run under another schedule and a fresh "
        f"start would overwrite it: give this run its own folder, e.g. config.CHECKPOINT.DIR="
        f"{free_folder(run_dir)} (or train on from it: config.CHECKPOINT.ALLOW_OTHER_SCHEDULE=True)",
        agreed=agreed,
    )


def _global_batch(cfg, world_size: Optional[int]) -> Optional[Tuple[int, str]]:
    """(images per optimizer step, how: "64 (2 ranks x 32)") of a config (or a saved one's dict)
    on ``world_size`` ranks; None when the ranks or a key are unknown (an older checkpoint)."""
    batch, steps = (
        _get_or_none(cfg, "DATA.TRAIN.BATCHSIZE_PER_REPLICA"),
        _get_or_none(cfg, "OPTIMIZER.update_freq"),
    )
    if not world_size or batch is None or steps is None:
        return None
    batch, steps = int(batch), int(steps)
    accumulated = f" x {steps} accumulated" if steps != 1 else ""
    return (
        world_size * batch * steps,
        f"{world_size * batch * steps} ({world_size} ranks x {batch}{accumulated})",
    )


def check_same_results(run_dir: str, recorded_text: str, cfg) -> None:
    """:class:`OtherRunError` (one line) when the folder's ``config.yaml`` (``recorded_text``)
    records another job, or another evaluation than ``cfg`` (any key outside :data:`NOT_RESULTS`):
    the job would overwrite the other's results. The same command in the same folder passes."""
    recorded = load_yaml(recorded_text)
    job, other = _get(cfg, "JOB"), recorded.get("JOB")
    if other != job:
        what = f"a {other} run" if other == "train" else f"the results of a {other} job"
        raise OtherRunError(
            f"{run_dir} holds {what}; this run is a {job} job and would overwrite its files: give it its own "
            f"folder, e.g. config.CHECKPOINT.DIR={free_folder(run_dir)}"
        )
    if job == "train":  # its checkpoints tell (check_same_run)
        return
    differs = differing(recorded, cfg, [key for key in cfg if key not in ("JOB", "VERSION")], NOT_RESULTS)
    if differs:
        raise OtherRunError(
            f"{run_dir} holds the results of another {job} job ({_values(differs, 0)}; this run: "
            f"{_values(differs, 1)}), which this run would overwrite: give it its own folder, e.g. "
            f"config.CHECKPOINT.DIR={free_folder(run_dir)}"
        )


def differing(recorded, cfg, keys, ignored=()) -> List[Tuple[str, object, object]]:
    """``[(dotted key, recorded value, cfg's value)]`` of every leaf under ``keys`` whose values
    differ, in key order; leaves under ``ignored`` and leaves only one side holds (a key added to
    vistrain since the folder was written: its default then in force) are no difference."""
    out = []
    for key in keys:
        mine, theirs = _get_or_none(cfg, key), _get_or_none(recorded, key)
        if mine is None or theirs is None:
            continue
        mine = dict(_leaves(mine, key))
        for leaf, value in _leaves(theirs, key):
            if leaf in mine and not _skipped(leaf, ignored) and _plain(mine[leaf]) != _plain(value):
                out.append((leaf, _plain(value), _plain(mine[leaf])))
    return out


def _leaves(value, key: str) -> Iterator[Tuple[str, object]]:
    if isinstance(value, dict):
        for name, child in value.items():
            yield from _leaves(child, f"{key}.{name}")
    else:
        yield key, value


def _skipped(key: str, ignored) -> bool:
    return any(key == prefix or key.startswith(f"{prefix}.") for prefix in ignored)


def _values(differs, side: int) -> str:
    """``KEY value, KEY value`` of the first :data:`SHOWN` differences (side 0: recorded, 1: this run's)."""
    shown = ", ".join(f"{key} {_text(values[side])}" for key, *values in differs[:SHOWN])
    return shown + (f" and {len(differs) - SHOWN} more" if len(differs) > SHOWN else "")


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


def _get_or_none(cfg, key: str):
    try:
        return _get(cfg, key)
    except (KeyError, TypeError):
        return None


def _plain(value):
    """A CfgNode / dict / list as plain, comparable Python values (lists as tuples)."""
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in sorted(value.items())}
    if isinstance(value, (list, tuple)):
        return tuple(_plain(v) for v in value)
    return value
