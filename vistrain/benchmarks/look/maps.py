"""A map of the embeddings: ``map.png``, the sampled images placed in 2-D so that images the trunk
finds alike lie close, coloured by class when there are labels, with some images drawn at their
place.

Each ``LOOK.MAP_METHODS`` entry is a panel, on the standardised features (every dimension centred
and scaled over the images):

* ``pca``: the two principal components (scikit-learn's PCA); distances along them are the
  features' own, the share of the variance they hold is in the panel's title;
* ``tsne``: t-SNE (van der Maaten and Hinton 2008; scikit-learn's Barnes-Hut, after a PCA to 50
  dimensions, perplexity min(30, (N - 1) / 3)): neighbourhoods kept, distances between clusters
  not meaningful; O(N log N) time, but it compares pairs: ``LOOK.MAX_IMAGES`` caps N;
* ``umap``: UMAP (McInnes et al. 2018), when ``umap-learn`` is installed.
"""

from typing import List, Tuple

import numpy as np

from vistrain.benchmarks.look.sample import Sample
from vistrain.config import InputError
from vistrain.runtime import pictures

THUMBNAIL_INCHES = 0.32  # drawn side of a thumbnail on the map
SPREAD = 0.07  # thumbnails at least this share of the map's extent apart


def project(features: np.ndarray, method: str, seed: int) -> Tuple[np.ndarray, str]:
    """(N, 2) coordinates of ``features`` (N, D) by ``method``, and the panel's title."""
    from sklearn.decomposition import PCA

    x = (features - features.mean(0)) / np.maximum(features.std(0), 1e-6)
    if method == "pca":
        pca = PCA(2, random_state=seed).fit(x)
        share = 100 * pca.explained_variance_ratio_.sum()
        return pca.transform(x), f"PCA ({share:.0f}% of the variance)"
    reduced = PCA(min(50, *x.shape), random_state=seed).fit_transform(x)
    if method == "tsne":
        from sklearn.manifold import TSNE

        perplexity = min(30.0, (len(x) - 1) / 3)
        coords = TSNE(2, perplexity=perplexity, init="pca", random_state=seed).fit_transform(reduced)
        return coords, f"t-SNE (perplexity {perplexity:.0f})"
    try:
        import umap
    except ImportError:
        raise InputError("LOOK.MAP_METHODS umap needs umap-learn: pip install umap-learn") from None
    return umap.UMAP(random_state=seed).fit_transform(reduced), "UMAP"


def spread(coords: np.ndarray, count: int, seed: int) -> List[int]:
    """Up to ``count`` rows whose points lie at least ``SPREAD`` of the map's extent apart (greedy,
    in a seeded random order): thumbnails that do not hide each other."""
    extent = np.maximum(coords.max(0) - coords.min(0), 1e-9)
    scaled = (coords - coords.min(0)) / extent
    chosen: List[int] = []
    for row in np.random.default_rng(seed).permutation(len(coords)):
        if len(chosen) == count:
            break
        if not chosen or np.min(np.linalg.norm(scaled[chosen] - scaled[row], axis=1)) >= SPREAD:
            chosen.append(int(row))
    return chosen


def draw(sample: Sample, cfg) -> Tuple[object, str]:
    """(the picture, a one-line description): one panel per ``LOOK.MAP_METHODS`` entry."""
    if len(sample.paths) < 4:
        raise InputError(f"a map needs at least 4 images, DATA.{cfg.LOOK.SPLIT} gave {len(sample.paths)}")
    features = sample.features.double().numpy()
    methods = list(cfg.LOOK.MAP_METHODS)
    fig = pictures.figure(7.0 * len(methods), 7.0)
    fig.suptitle(
        f"{len(sample.paths)} of {sample.total} images of DATA.{cfg.LOOK.SPLIT}, feature {cfg.LOOK.FEATURE}"
    )
    for i, method in enumerate(methods):
        coords, title = project(features, method, cfg.SEED_VALUE)
        axes = fig.add_subplot(1, len(methods), i + 1)
        _scatter(axes, coords, sample)
        _thumbnails(axes, coords, sample, spread(coords, cfg.LOOK.THUMBNAILS, cfg.SEED_VALUE))
        axes.set_title(title)
        axes.set_xticks([])
        axes.set_yticks([])
    return pictures.figure_image(fig), f"{', '.join(methods)} of {len(sample.paths)} images"


def _scatter(axes, coords: np.ndarray, sample: Sample) -> None:
    """Points coloured by class (a legend up to 20 classes, a colour bar beyond), grey without labels."""
    if not sample.labelled:
        axes.scatter(coords[:, 0], coords[:, 1], s=6, color="tab:gray")
        return
    labels = sample.labels.numpy()
    classes = int(labels.max()) + 1
    if classes > 20:
        points = axes.scatter(coords[:, 0], coords[:, 1], s=6, c=labels, cmap="turbo")
        axes.figure.colorbar(points, ax=axes, label="class", shrink=0.6)
        return
    cmap = _colours(classes)
    for c in range(classes):
        mine = labels == c
        if mine.any():
            name = sample.class_names[c] if c < len(sample.class_names) else str(c)
            axes.scatter(coords[mine, 0], coords[mine, 1], s=6, color=cmap(c), label=name)
    axes.legend(markerscale=3, fontsize="small", loc="best", title="class")


def _colours(classes: int):
    """The qualitative colour map of up to 20 classes."""
    import matplotlib

    return matplotlib.colormaps["tab10" if classes <= 10 else "tab20"]


def _thumbnails(axes, coords: np.ndarray, sample: Sample, rows: List[int]) -> None:
    """Each of ``rows``' images at its point, framed in its class's colour."""
    from matplotlib.offsetbox import AnnotationBbox, OffsetImage

    classes = int(sample.labels.max()) + 1 if sample.labelled else 0
    cmap = _colours(classes) if 0 < classes <= 20 else None
    dpi = axes.figure.dpi
    for row in rows:
        pixels = sample.pixels(row)
        image = OffsetImage(pixels, zoom=THUMBNAIL_INCHES * dpi / pixels.shape[0])
        colour = cmap(int(sample.labels[row])) if cmap is not None else "black"
        box = AnnotationBbox(
            image, coords[row], frameon=True, pad=0.1, bboxprops={"edgecolor": colour, "linewidth": 2}
        )
        axes.add_artist(box)
