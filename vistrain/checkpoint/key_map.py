"""Checkpoint key -> model key for ``MODEL.WEIGHTS_INIT``: the prefixes given, or found by matching.

A key maps as ``APPEND_PREFIX + key`` with ``REMOVE_PREFIX`` stripped first (keys without it stay
as they are). With both prefixes empty the pair is found (:func:`find_key_map`): among the
candidates, each of

* remove: "" or a run of leading components (at most ``DEPTH``) that at least ``SHARE`` of the
  checkpoint's keys start with (``module.``, ``model.``, ``backbone.``, ``state_dict.encoder.``...);
* append: "" or such a run of the model's keys (``trunk.``, ``trunk.timm.``, ``trunk.torchvision.``),

the pair under which the most checkpoint keys that start with its remove part land on a model key
of the same shape wins; ties go to the shorter pair (no change first). So torchvision's
``resnet50().state_dict()`` (``conv1.weight``...) loads into a vistrain ResNet (``trunk.conv1...``),
a checkpoint saved from DDP (``module.``) into a plain model, and a vistrain checkpoint holding a
student and its momentum teacher (``teacher.``) loads the student, whose keys need no change.

Checkpoint keys that map into the trunk onto nothing and whose first component (after the removed
part) names a classifier (:data:`CLASSIFIERS`) are the checkpoint's classifier, ignored; the errors
below name keys on both sides and the fix, in one line.
"""

from collections import Counter
from dataclasses import dataclass
from typing import List, Mapping, Sequence, Tuple

from vistrain.checkpoint.files import CheckpointError

CLASSIFIERS = ("fc", "head", "heads", "classifier")  # first components of a classifier's keys
SHARE = 0.1  # a candidate prefix starts at least this share of the keys
DEPTH = 3  # a candidate prefix has at most this many components
TRUNK = "trunk."  # the model's trunk keys: all of them must be loaded
IGNORED_MISSING = ("mask_token",)  # trunk keys a checkpoint may lack (masked-image pretraining's)
FIX = "set MODEL.WEIGHTS_INIT.REMOVE_PREFIX / APPEND_PREFIX (or SKIP_LAYERS), or MODEL.TRUNK to the checkpoint's trunk"

Shapes = Mapping[str, Tuple[int, ...]]


def map_key(key: str, remove_prefix: str, append_prefix: str) -> str:
    if remove_prefix and key.startswith(remove_prefix):
        key = key[len(remove_prefix) :]
    return append_prefix + key


@dataclass(frozen=True)
class KeyMap:
    """``REMOVE_PREFIX`` / ``APPEND_PREFIX`` as used; ``found``: chosen by :func:`find_key_map`."""

    remove: str
    append: str
    found: bool = False

    def __call__(self, key: str) -> str:
        return map_key(key, self.remove, self.append)

    def describe(self) -> str:
        how = "found by matching the keys" if self.found else "as configured"
        return f"REMOVE_PREFIX={self.remove!r}, APPEND_PREFIX={self.append!r} ({how})"

    def is_classifier(self, key: str) -> bool:
        """Whether checkpoint key ``key`` belongs to a library model's classifier (``fc.``,
        ``head.``...): a key that maps into the trunk and whose first component names one (our
        own ``head.`` keys map outside the trunk)."""
        stripped = key[len(self.remove) :] if self.remove and key.startswith(self.remove) else key
        return self(key).startswith(TRUNK) and stripped.split(".")[0] in CLASSIFIERS


def leading_prefixes(keys: Sequence[str], share: float = SHARE, depth: int = DEPTH) -> List[str]:
    """Runs of 1..``depth`` leading components (with their dot) that at least ``share`` of
    ``keys`` start with, most common first."""
    counts: Counter = Counter()
    for key in keys:
        parts = key.split(".")
        counts.update(".".join(parts[:i]) + "." for i in range(1, min(depth, len(parts) - 1) + 1))
    least = max(1, share * len(keys))
    return [prefix for prefix, n in counts.most_common() if n >= least]


def match_count(shapes: Shapes, targets: Shapes, remove: str, append: str, skip: Sequence[str] = ()) -> int:
    """Checkpoint keys starting with ``remove`` that map onto a model key of the same shape."""
    count = 0
    for key, shape in shapes.items():
        if key.startswith(remove):
            name = append + key[len(remove) :]
            if name in targets and tuple(targets[name]) == tuple(shape) and not any(s in name for s in skip):
                count += 1
    return count


def find_key_map(shapes: Shapes, targets: Shapes, skip: Sequence[str] = ()) -> KeyMap:
    """The (remove, append) pair mapping the most checkpoint keys (``shapes``: key -> shape) onto
    model keys of equal shape (``targets``: model key -> shape); see the module docstring."""
    removes = ["", *leading_prefixes(list(shapes))]
    appends = ["", *leading_prefixes(list(targets))]
    pairs = sorted(((r, a) for r in removes for a in appends), key=lambda p: (len(p[0]) + len(p[1]), p))
    best, best_count = ("", ""), -1
    for remove, append in pairs:
        count = match_count(shapes, targets, remove, append, skip)
        if count > best_count:
            best, best_count = (remove, append), count
    return KeyMap(*best, found=True)


def first(keys: Sequence[str], shown: int = 3) -> str:
    """A few of ``keys`` and how many there are, for one line."""
    if not keys:
        return "none"
    return ", ".join(keys[:shown]) + (f", ... ({len(keys)} in all)" if len(keys) > shown else "")


def no_match_error(path: str, shapes: Shapes, targets: Shapes, key_map: KeyMap) -> CheckpointError:
    """No checkpoint key lands on a model key of its shape."""
    keys = list(shapes)
    mapped = [key_map(k) for k in keys[:3]]
    return CheckpointError(
        f"{path}: no key matches the model with {key_map.describe()}: checkpoint keys "
        f"{first(keys)} map to {first(mapped)}; the model's keys are {first(list(targets))}; {FIX}"
    )


def trunk_missing(missing: Sequence[str]) -> List[str]:
    """The missing model keys that leave the trunk partly at its initial values."""
    return [k for k in missing if k.startswith(TRUNK) and not k.endswith(IGNORED_MISSING)]


def missing_trunk_error(
    path: str, missing: Sequence[str], unmatched: Sequence[str], key_map: KeyMap
) -> CheckpointError:
    """Trunk keys the checkpoint does not give (``missing``), with the mapped checkpoint keys
    that found no place (``unmatched``): a checkpoint of another trunk, or a wrong prefix."""
    return CheckpointError(
        f"{path} does not fit the model's trunk: missing {first(missing)}; the checkpoint's unmatched "
        f"keys {first(unmatched)} (mapped with {key_map.describe()}); {FIX} "
        "(SKIP_LAYERS: trunk keys containing it stay at their initial values)"
    )
