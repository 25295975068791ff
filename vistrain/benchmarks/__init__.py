"""Benchmarks of a frozen, pretrained trunk, run through the same launcher as training.

    python tools/run_distributed.py config=benchmark/linear_eval_regnet \
        config.MODEL.WEIGHTS_INIT.PARAMS_FILE=./checkpoints/regnet_fsdp

Engines (``JOB``): ``linear_eval`` (one linear head per trunk feature), ``knn`` (weighted
k-nearest neighbours), ``finetune`` (the trunk and a linear head trained end to end) and
``extract_features`` (features, labels, indices and paths to disk). The first three may see a stratified
fraction of the labels only (``DATA.TRAIN.LABEL_FRACTION``, :mod:`.label_fraction`). Pictures of
what a trained trunk learned (maps, neighbours, attention, near-duplicates) are :mod:`.look`'s, drawn
by ``tools/look.py`` on a run folder.
"""

from vistrain.benchmarks.extract_features import extract_features
from vistrain.benchmarks.finetune import finetune
from vistrain.benchmarks.knn import knn, knn_class_scores, knn_topk_hits
from vistrain.benchmarks.linear_eval import LinearHeads, linear_eval

__all__ = [
    "LinearHeads",
    "extract_features",
    "finetune",
    "knn",
    "knn_class_scores",
    "knn_topk_hits",
    "linear_eval",
]
