"""The sheets of images: nearest neighbours (``neighbours.png``), near-duplicates and outliers
(``duplicates.png``, ``duplicates.csv``, ``outliers.csv``), by the cosine similarity of
:mod:`vistrain.benchmarks.look.similarity` among the sampled images. Labels are not needed: they
only caption the tiles.

``duplicates.csv``: every pair at or above ``LOOK.DUPLICATE_SIMILARITY`` (at most ``MAX_PAIRS``,
the most similar), most similar first: ``similarity, index_a, path_a, label_a, index_b, path_b,
label_b``. ``outliers.csv``: every sampled image, the least typical first: ``score, index, path,
label``, the score its mean similarity to its ``LOOK.OUTLIER_K`` most similar images.
"""

import csv
import os
from typing import List, Tuple

from PIL import Image

from vistrain.benchmarks.look import similarity
from vistrain.benchmarks.look.sample import Sample
from vistrain.runtime import pictures

SIDE = 96  # pixels of a tile
PAIRS_PER_ROW = 4
MAX_PAIRS = 100_000  # rows of duplicates.csv at most (the most similar pairs)


def caption(sample: Sample, row: int, similarity_value=None) -> str:
    """A tile's caption: its class (or data set index), and its similarity when given."""
    what = sample.label(row) or f"#{int(sample.indices[row])}"
    return what if similarity_value is None else f"{what}  {similarity_value:.2f}"


def neighbours(sample: Sample, cfg) -> Tuple[object, str]:
    """(the sheet, a one-line description): each query image, then its ``LOOK.NEIGHBOURS`` most
    similar images among the sample, captioned with their class and similarity."""
    unit = similarity.unit_rows(sample.features)
    queries = sample.examples(cfg.LOOK.QUERIES)
    near, sims = similarity.nearest(unit, queries, cfg.LOOK.NEIGHBOURS)
    rows, captions = [], []
    for q, found, values in zip(queries, near.tolist(), sims.tolist()):
        rows.append([sample.pixels(q)] + [sample.pixels(r) for r in found])
        captions.append(
            [f"query: {caption(sample, q)}"] + [caption(sample, r, v) for r, v in zip(found, values)]
        )
    title = (
        f"nearest neighbours among {len(sample.paths)} images of DATA.{cfg.LOOK.SPLIT} "
        f"(cosine similarity of {cfg.LOOK.FEATURE}, standardised)"
    )
    return pictures.tile(rows, SIDE, captions, title), f"{len(queries)} queries x {near.shape[1]} neighbours"


def duplicates(sample: Sample, cfg, out_dir: str) -> Tuple[object, str]:
    """(the sheet, a one-line description); writes ``duplicates.csv`` and ``outliers.csv`` to
    ``out_dir``. The sheet: the ``LOOK.SHEET_ROWS`` x 4 most similar pairs, then as many rows of
    outliers."""
    look = cfg.LOOK
    unit = similarity.unit_rows(sample.features)
    pairs, sims = similarity.similar_pairs(unit, look.DUPLICATE_SIMILARITY, MAX_PAIRS)
    scores = similarity.outlier_scores(unit, look.OUTLIER_K)
    order = scores.argsort().tolist()
    write_pairs(os.path.join(out_dir, "duplicates.csv"), sample, pairs.tolist(), sims.tolist())
    write_outliers(os.path.join(out_dir, "outliers.csv"), sample, order, scores.tolist())
    heading = f"{len(pairs)} pairs at similarity >= {look.DUPLICATE_SIMILARITY:g}"
    shown = PAIRS_PER_ROW * look.SHEET_ROWS
    top = _pairs_sheet(sample, pairs[:shown].tolist(), sims[:shown].tolist(), heading)
    outliers = order[: 2 * shown]
    per_row = 2 * PAIRS_PER_ROW
    tiles = [sample.pixels(r) for r in outliers]
    captions = [caption(sample, r, scores[r].item()) for r in outliers]
    bottom = pictures.tile(
        [tiles[i : i + per_row] for i in range(0, len(tiles), per_row)],
        SIDE,
        [captions[i : i + per_row] for i in range(0, len(captions), per_row)],
        f"outliers: the lowest mean similarity to their {look.OUTLIER_K} nearest images",
    )
    title = (
        f"near-duplicates and outliers among {len(sample.paths)} images of DATA.{look.SPLIT} ({look.FEATURE})"
    )
    sheet = pictures.titled(pictures.stack([top, bottom]), title)
    return sheet, f"{len(pairs)} near-duplicate pairs; outliers ranked"


def _pairs_sheet(sample: Sample, pairs: List[List[int]], sims: List[float], heading: str):
    """Each pair side by side, the second captioned with the similarity, ``PAIRS_PER_ROW`` pairs a row."""
    if not pairs:
        return pictures.titled(Image.new("RGB", (2 * PAIRS_PER_ROW * SIDE, 1), pictures.BACKGROUND), heading)
    drawn = [
        pictures.tile(
            [[sample.pixels(a), sample.pixels(b)]], SIDE, [[caption(sample, a), caption(sample, b, v)]]
        )
        for (a, b), v in zip(pairs, sims)
    ]
    return pictures.titled(pictures.arrange(drawn, PAIRS_PER_ROW), heading + ", the most similar first")


def write_pairs(path: str, sample: Sample, pairs: List[List[int]], sims: List[float]) -> None:
    with open(path, "w", newline="") as f:
        out = csv.writer(f)
        out.writerow(["similarity", "index_a", "path_a", "label_a", "index_b", "path_b", "label_b"])
        for (a, b), value in zip(pairs, sims):
            out.writerow([f"{value:.6f}", *_image(sample, a), *_image(sample, b)])


def write_outliers(path: str, sample: Sample, order: List[int], scores: List[float]) -> None:
    with open(path, "w", newline="") as f:
        out = csv.writer(f)
        out.writerow(["score", "index", "path", "label"])
        for row in order:
            out.writerow([f"{scores[row]:.6f}", *_image(sample, row)])


def _image(sample: Sample, row: int) -> list:
    return [int(sample.indices[row]), sample.paths[row], int(sample.labels[row])]
