"""A benchmark's trunk weights: ``MODEL.WEIGHTS_INIT`` loaded into the plain model, the student's
or (``BENCHMARK.WEIGHTS_FROM: teacher``) the momentum teacher's, with the refusals a benchmark needs.

A checkpoint of DINO or BYOL holds the student under its own names and the teacher beside it under
``teacher.``; the teacher's network is read by keeping only the keys that start with ``teacher.``
and stripping that prefix (before ``WEIGHTS_INIT.REMOVE_PREFIX``).
"""

from typing import List, Tuple

from torch import nn

from vistrain.checkpoint import load_pretrained
from vistrain.distributed import comm
from vistrain.runtime.logger import logger

# BENCHMARK.WEIGHTS_FROM -> the prefix of that network's keys in a pretraining checkpoint
WEIGHTS_FROM = {"student": "", "teacher": "teacher."}


def load_weights(
    model: nn.Module, weights_cfg, weights_from: str = "student", what: str = "evaluating"
) -> None:
    """Load ``WEIGHTS_INIT.PARAMS_FILE`` (any checkpoint format) into the plain model; keep the
    random initialisation when it is "" (said loudly: ``what`` a RANDOMLY INITIALISED trunk).

    ``load_pretrained`` already rejects shape mismatches; a benchmark also refuses a trunk that
    would be evaluated partly at random (missing keys) or a checkpoint of a bigger trunk
    (unexpected ``trunk.`` keys), naming the keys.
    """
    if not weights_cfg.PARAMS_FILE:
        if comm.is_main_process():
            logger.warning("MODEL.WEIGHTS_INIT.PARAMS_FILE is empty: evaluating a RANDOMLY INITIALISED trunk")
        return
    weights_cfg, prefix = network_weights(weights_cfg, weights_from)
    report = load_pretrained(model, weights_cfg, only_prefix=prefix)
    # a masked-image pretraining's mask token (iBOT, DINOv2) is never read without masks
    unexpected = [key for key in report.unexpected if key.startswith("trunk.") and key != "trunk.mask_token"]
    if report.missing or unexpected:
        raise ValueError(
            f"{weights_cfg.PARAMS_FILE} does not match the trunk of MODEL.TRUNK: "
            f"missing {_first(report.missing)}; unexpected {_first(unexpected)} "
            "(a different trunk configuration, or check WEIGHTS_INIT.REMOVE_PREFIX / APPEND_PREFIX)"
        )


def network_weights(weights_cfg, weights_from: str) -> Tuple[object, str]:
    """(``WEIGHTS_INIT`` mapping that network's keys onto the model's, the prefix of its keys)."""
    prefix = WEIGHTS_FROM[weights_from]
    if not prefix:
        return weights_cfg, prefix
    mapped = weights_cfg.clone()
    mapped.defrost()
    mapped.REMOVE_PREFIX = prefix + weights_cfg.REMOVE_PREFIX
    mapped.freeze()
    return mapped, prefix


def _first(keys: List[str], shown: int = 5) -> str:
    if not keys:
        return "none"
    return ", ".join(keys[:shown]) + (f", ... ({len(keys)} in all)" if len(keys) > shown else "")
