"""The model card written beside an exported trunk: ``<OUT without suffix>.README.md``.

It holds the exact lines that load the file (the family's ``load_line``, with the imports it
needs: :func:`runnable`), what trained the trunk
(``LOSS.NAME``, ``DATA.TRAIN.DATA_SOURCES`` / ``DATA_PATHS``, epochs, from the run's
``config.yaml`` and the checkpoint's metadata) and the top-1 of every feature of each evaluation
of it: the ``metrics.json`` of every sibling run folder (the benchmarks write one) whose recorded
``weights`` names this run (the run folder, or a checkpoint in it) and whose ``weights_from`` is
the exported network, and of every folder given (``--eval``).
"""

import ast
import json
import os
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence

from vistrain.checkpoint.export import Export
from vistrain.config import InputError
from vistrain.models.trunks import TRUNKS

METRICS = "metrics.json"  # what an evaluation (vistrain.benchmarks) writes into its run folder
# names a loading line may use -> the import that makes them available
LIBRARIES = {
    "safetensors": "safetensors.torch",
    "timm": "timm",
    "torch": "torch",
    "torchvision": "torchvision",
}


@dataclass
class Evaluation:
    """One evaluation run's results: feature -> top-1 (%)."""

    folder: str
    engine: str
    network: str  # "student" or "teacher"
    top1: Dict[str, float]


def card_path(out: str) -> str:
    """``trunk.safetensors`` -> ``trunk.README.md``, beside it."""
    return os.path.splitext(out)[0] + ".README.md"


def write_card(export: Export, evaluations: Sequence["Evaluation"] = ()) -> str:
    """Write the card of ``export`` with ``evaluations`` (:func:`read_evaluation` of folders given)
    and those found beside the run; returns its path."""
    path = card_path(export.out)
    evaluations = list(evaluations)
    if export.run_dir is not None:
        given = {os.path.realpath(e.folder) for e in evaluations}
        found = sibling_evaluations(export.run_dir, export.network)
        evaluations += [e for e in found if os.path.realpath(e.folder) not in given]
    with open(path, "w") as f:
        f.write(card_text(export, evaluations))
    return path


def read_evaluation(folder: str) -> Evaluation:
    """The results in ``folder/metrics.json``; InputError (one line) without a readable one."""
    record = _record(folder)
    if record is None:
        raise InputError(
            f"--eval {folder}: holds no readable {METRICS} (the run folder of a linear_eval, knn or finetune job)"
        )
    return _evaluation(folder, record)


def sibling_evaluations(run_dir: str, network: str) -> List[Evaluation]:
    """Evaluations of ``run_dir``'s ``network`` in the folders beside it, by folder name."""
    parent = os.path.dirname(os.path.abspath(run_dir))
    found = []
    for name in sorted(os.listdir(parent)):
        folder = os.path.join(parent, name)
        record = _record(folder) if os.path.realpath(folder) != os.path.realpath(run_dir) else None
        if record is not None and _names_run(record.get("weights"), run_dir):
            evaluation = _evaluation(folder, record)
            if evaluation.network == network:
                found.append(evaluation)
    return found


def _record(folder: str) -> Optional[dict]:
    try:
        with open(os.path.join(folder, METRICS)) as f:
            record = json.load(f)
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) and isinstance(record.get("results"), dict) else None


def _evaluation(folder: str, record: dict) -> Evaluation:
    top1 = {
        feature: r["top1"] for feature, r in record["results"].items() if isinstance(r, dict) and "top1" in r
    }
    return Evaluation(folder, str(record.get("engine", "?")), record.get("weights_from", "student"), top1)


def _names_run(weights, run_dir: str) -> bool:
    """Whether WEIGHTS_INIT.PARAMS_FILE ``weights`` is ``run_dir`` or a path inside it."""
    if not isinstance(weights, str) or not weights:
        return False
    weights, run = os.path.realpath(weights), os.path.realpath(run_dir)
    return weights == run or weights.startswith(run + os.sep)


def card_text(export: Export, evaluations: Sequence[Evaluation]) -> str:
    """The card's Markdown."""
    name = os.path.basename(export.out)
    lines = [
        f"# {_trunk_title(export)}",
        "",
        f"`{name}`: the {export.network}'s trunk of `{export.source}`{_progress(export.meta)}, "
        f"{len(export.specs)} tensors in {export.library}'s keys, without the classifier's last layer.",
        "",
        "## Loading",
        "",
        *_loading(export, name),
        "",
        "## Training",
        "",
        *_training(export.cfg, export.meta),
        "",
        "## Evaluation",
        "",
        *_evaluation_table(evaluations),
    ]
    return "\n".join(lines) + "\n"


def _trunk_title(export: Export) -> str:
    cfg = export.cfg
    if cfg is None:
        return f"{export.family} trunk"
    section = cfg.MODEL.TRUNK.get(export.family.upper(), {})  # REGNET, TIMM...: its NAME is the size
    size = f" {section['NAME']}" if "NAME" in section else ""
    return f"{export.family}{size} trunk of {os.path.basename(os.path.normpath(export.run_dir or ''))}"


def _progress(meta: dict) -> str:
    if "iteration" not in meta:
        return ""
    return f" (iteration {meta['iteration']}, epoch {_epochs(meta)})"


def _epochs(meta: dict) -> str:
    done = meta.get("epoch", 0) + meta.get("iteration_in_epoch", 0) / max(meta.get("iters_per_epoch") or 1, 1)
    return f"{done:g}"


def _loading(export: Export, name: str) -> List[str]:
    """The load lines (a code block), or why there are none."""
    fam = TRUNKS.get(export.family)
    if export.cfg is None or fam is None or fam.load_line is None:
        return [
            f"Build the {export.library} model of the trunk's shapes with its classifier replaced by "
            f"`torch.nn.Identity()`, then `model.load_state_dict(...)` the file (strict)."
        ]
    try:
        code = fam.load_line(export.cfg.MODEL.TRUNK, export.library, name)
    except ValueError as error:
        return [f"No {export.library} model has this trunk: {error}."]
    return ["```python", runnable(code), "```"]


def runnable(code: str) -> str:
    """A family's ``load_line`` as a script: the imports of the libraries it names first, and
    ``model = `` before it when it is an expression."""
    tree = ast.parse(code)
    if len(tree.body) == 1 and isinstance(tree.body[0], ast.Expr):
        code = f"model = {code}"
    names = {node.id for node in ast.walk(tree) if isinstance(node, ast.Name)}
    imports = [f"import {module}" for root, module in LIBRARIES.items() if root in names]
    return "\n".join([*imports, code])


def _training(cfg, meta: dict) -> List[str]:
    if cfg is None:
        return ["No `config.yaml` beside the checkpoint: the method, data and epochs are unknown."]
    data = ", ".join(cfg.DATA.TRAIN.DATA_SOURCES) or "none"
    paths = ", ".join(f"`{p}`" for p in cfg.DATA.TRAIN.DATA_PATHS if p)
    trained = f"{_epochs(meta)} of " if "iteration" in meta else ""
    return [
        "| | |",
        "|---|---|",
        f"| method (`LOSS.NAME`) | {cfg.LOSS.NAME} |",
        f"| data (`DATA.TRAIN`) | {data}{f' ({paths})' if paths else ''} |",
        f"| epochs | {trained}{cfg.OPTIMIZER.num_epochs} |",
        f"| trunk (`MODEL.TRUNK.NAME`) | {cfg.MODEL.TRUNK.NAME} |",
    ]


def _evaluation_table(evaluations: Sequence[Evaluation]) -> List[str]:
    if not evaluations:
        return [
            "None found: no run folder beside this run holds a metrics.json of its weights "
            "(`tools/convert_checkpoint.py ... --eval DIR` names evaluation folders)."
        ]
    rows = ["| evaluation | engine | network | feature | top-1 (%) |", "|---|---|---|---|---|"]
    for e in evaluations:
        folder = os.path.basename(os.path.normpath(e.folder))
        rows += [f"| {folder} | {e.engine} | {e.network} | {f} | {t:.2f} |" for f, t in e.top1.items()]
    return rows
