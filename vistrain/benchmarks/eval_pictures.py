"""What linear evaluation draws for the picked feature: the test confusion matrix of its head and a
sheet of test images beside their nearest training images by that feature.

Both come from one more pass over DATA.TEST (features, predictions; collective, each image once)
and the training features the probe used (the cached bank, or one pass over DATA.TRAIN). Rank 0
draws: ``confusion.png`` and ``neighbours.png`` in the run folder, and the same as TensorBoard
images ``linear_eval/confusion`` and ``linear_eval/neighbours``.
"""

from typing import List, Sequence, Tuple

import numpy as np
import torch

from vistrain.benchmarks import common
from vistrain.data import set_epoch
from vistrain.distributed import comm
from vistrain.runtime import pictures

QUERIES_PER_CLASS = 2  # rows of the neighbour sheet per class
NEIGHBOURS = 5


@torch.no_grad()
def test_outputs(
    source, heads, loader, feature: str
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Collective: (indices (N,), labels (N,), predicted class (N,), features (N, D)) of every test
    image once, sorted by index, for the head of ``feature``; the same on all ranks."""
    heads.eval()
    set_epoch(loader, 0)
    indices, labels, predicted, feats = [], [], [], []
    for batch in loader:
        features, batch_labels = source(batch)
        predicted.append(heads(features)[feature].argmax(dim=1))
        feats.append(features[feature])
        labels.append(batch_labels)
        indices.append(batch["index"].to(batch_labels.device))
    index, (label, prediction, feature_rows) = common.gather_unique(
        torch.cat(indices), torch.cat(labels), torch.cat(predicted), torch.cat(feats)
    )
    return index, label, prediction, feature_rows


def confusion(labels: torch.Tensor, predicted: torch.Tensor, num_classes: int) -> np.ndarray:
    """(C, C) int64 counts: row = true class, column = predicted class."""
    flat = labels.long().cpu() * num_classes + predicted.long().cpu()
    return torch.bincount(flat, minlength=num_classes * num_classes).view(num_classes, num_classes).numpy()


def nearest(queries: torch.Tensor, bank: torch.Tensor, k: int) -> torch.Tensor:
    """(Q, k) rows of ``bank`` (N, D) nearest to each of ``queries`` (Q, D) by cosine similarity
    after standardising every dimension with the bank's mean and std (as the probe's BatchNorm does)."""
    mean, std = bank.mean(dim=0), bank.std(dim=0).clamp_min(1e-6)
    q = torch.nn.functional.normalize((queries - mean) / std, dim=1)
    b = torch.nn.functional.normalize((bank - mean) / std, dim=1)
    return (q @ b.t()).topk(min(k, bank.shape[0]), dim=1).indices


def pick_queries(labels: torch.Tensor, per_class: int) -> List[int]:
    """Positions of the first ``per_class`` test images of every class (a fixed, readable choice)."""
    chosen = []
    for label in sorted(set(labels.tolist())):
        chosen += torch.nonzero(labels == label).flatten()[:per_class].tolist()
    return chosen


def draw(cfg, source, heads, loaders, feature: str, bank, num_classes: int, writer, step: int) -> List[str]:
    """Collective: both pictures of ``feature`` (the picked one). ``bank``: the probe's cached
    training features (``CachedFeatures``: ``bank``, ``rows``); ``loaders``: (TRAIN, TEST).
    Returns the paths written (rank 0; [] elsewhere)."""
    train_loader, test_loader = loaders
    outputs = test_outputs(source, heads, test_loader, feature)
    train_index = torch.nonzero(bank.rows >= 0).flatten()
    train_feats = bank.bank[feature][bank.rows[train_index]]
    train_set = whole_data_set(train_loader.dataset)  # the bank's rows are data set indices
    train_labels = torch.as_tensor(train_set.targets)[train_index.cpu()]
    datasets = (train_set, test_loader.dataset)
    info = {
        "feature": feature,
        "num_classes": num_classes,
        "class_names": class_names(test_loader.dataset),
        "transforms": (cfg.DATA.TRAIN.TRANSFORMS, cfg.DATA.TEST.TRANSFORMS),
        "step": step,
    }
    return write(
        cfg.CHECKPOINT.DIR, writer, outputs, (train_index, train_labels, train_feats), datasets, info
    )


def write(
    run_dir: str, writer, outputs, train_bank: Tuple[torch.Tensor, torch.Tensor, torch.Tensor], datasets, info
):
    """Rank 0: draw and save both pictures. ``outputs``: :func:`test_outputs`; ``train_bank``:
    (indices (M,), labels (M,), features (M, D)) of DATA.TRAIN; ``datasets``: (train, test)
    SSLDatasets read with an eval transform; ``info``: {"feature", "num_classes", "class_names",
    "transforms": (train TRANSFORMS, test TRANSFORMS), "step"}."""
    if not comm.is_main_process():
        return []
    index, labels, predicted, feats = outputs
    names = info["class_names"] or [str(c) for c in range(info["num_classes"])]
    paths = [write_confusion(run_dir, writer, (labels, predicted), info, "linear_eval")]
    train_index, train_labels, train_feats = train_bank
    queries = pick_queries(labels, QUERIES_PER_CLASS)
    near = nearest(feats[queries].cpu(), train_feats.cpu(), NEIGHBOURS)
    (train_set, test_set), (train_t, test_t) = datasets, info["transforms"]
    rows, captions = [], []
    for q, row in zip(queries, near.tolist()):
        rows.append(
            [_image(test_set, int(index[q]), test_t)]
            + [_image(train_set, int(train_index[r]), train_t) for r in row]
        )
        captions.append(
            [f"{names[int(labels[q])]}->{names[int(predicted[q])]}"]
            + [names[int(train_labels[r])] for r in row]
        )
    sheet = pictures.tile(rows, side=96, captions=captions)
    paths.append(
        pictures.save_picture(
            sheet, run_dir, "neighbours.png", writer, "linear_eval/neighbours", info["step"]
        )
    )
    return paths


def write_confusion(run_dir: str, writer, outputs, info: dict, engine: str) -> str:
    """Rank 0: ``confusion.png`` and the TensorBoard image ``<engine>/confusion`` of ``outputs``
    (labels (N,), predicted classes (N,)); ``info``: {"feature", "num_classes", "class_names",
    "step"}. Returns the path."""
    labels, predicted = outputs
    names = info["class_names"] or [str(c) for c in range(info["num_classes"])]
    matrix = confusion(labels, predicted, info["num_classes"])
    title = f"{info['feature']}: test top-1 {100.0 * np.trace(matrix) / max(matrix.sum(), 1):.1f}%"
    image = pictures.confusion_image(matrix, names, title)
    return pictures.save_picture(image, run_dir, "confusion.png", writer, f"{engine}/confusion", info["step"])


def whole_data_set(dataset):
    """The data set a loader's ``IndexSubset`` (a label fraction, a fold) selects from, else ``dataset``."""
    return getattr(dataset, "dataset", dataset)


def _image(dataset, index: int, transforms) -> np.ndarray:
    return pictures.to_pixels(dataset.views((index, 0))[0], transforms.MEAN, transforms.STD)


def class_names(dataset) -> Sequence[str]:
    """The first source's ``class_names`` when it has them (ELPV: defect probabilities), else ()."""
    return tuple(getattr(dataset.sources[0], "class_names", ())) if hasattr(dataset, "sources") else ()
