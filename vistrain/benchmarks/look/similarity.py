"""Cosine similarity between the embedded images, and what it finds: nearest neighbours,
near-duplicate pairs, outliers. Pure functions on CPU tensors, in chunks of rows so that N images
need O(N * CHUNK) memory (the time still grows as N^2).

The features are standardised first: every dimension centred and scaled by its mean and std over
the N images (as the linear probe's BatchNorm and ``neighbours.png`` of linear evaluation do), then
each row L2-normalised. A trunk's pooled features after a ReLU all point into one orthant, where the
plain cosine of any two images is close to 1; centred, it reads like a correlation: 1 for identical
features, about 0 for unrelated images.
"""

from typing import List, Tuple

import torch
import torch.nn.functional as F

CHUNK = 1024  # rows of the (N, N) similarity matrix computed at once


def unit_rows(features: torch.Tensor) -> torch.Tensor:
    """(N, D) -> (N, D) float32: each dimension standardised over the N rows, each row L2-normalised;
    ``unit_rows(f) @ unit_rows(f).T`` is the similarity every function here uses."""
    x = features.float()
    x = (x - x.mean(dim=0)) / x.std(dim=0).clamp_min(1e-6)
    return F.normalize(x, dim=1)


def nearest(unit: torch.Tensor, rows: List[int], k: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """The ``k`` rows most similar to each of ``rows``, itself left out: (indices (Q, k) int64,
    similarities (Q, k)), most similar first (k capped at N - 1)."""
    k = min(k, unit.shape[0] - 1)
    sims = unit[rows] @ unit.t()
    sims[torch.arange(len(rows)), torch.as_tensor(rows)] = -float("inf")
    top = sims.topk(k, dim=1)
    return top.indices, top.values


def similar_pairs(unit: torch.Tensor, threshold: float, limit: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """Pairs (i, j), i < j, whose similarity is at least ``threshold``: (pairs (P, 2) int64,
    similarities (P,)), most similar first, at most ``limit`` of them (the most similar)."""
    found_pairs, found_sims = [torch.zeros(0, 2, dtype=torch.long)], [torch.zeros(0)]
    n = unit.shape[0]
    for start in range(0, n, CHUNK):
        sims = unit[start : start + CHUNK] @ unit.t()  # (c, N)
        rows = torch.arange(start, start + sims.shape[0])[:, None]
        keep = (sims >= threshold) & (torch.arange(n)[None, :] > rows)  # each pair once
        i, j = keep.nonzero(as_tuple=True)
        chunk_sims = sims[i, j]
        best = chunk_sims.argsort(descending=True, stable=True)[:limit]  # bounded memory
        found_pairs.append(torch.stack([i[best] + start, j[best]], dim=1))
        found_sims.append(chunk_sims[best])
    pairs, sims = torch.cat(found_pairs), torch.cat(found_sims)
    order = sims.argsort(descending=True, stable=True)[:limit]
    return pairs[order], sims[order]


def outlier_scores(unit: torch.Tensor, k: int) -> torch.Tensor:
    """(N,): each row's mean similarity to its ``k`` most similar other rows (k capped at N - 1);
    the lowest are the outliers: images nothing else in the data set resembles."""
    n = unit.shape[0]
    k = min(k, n - 1)
    scores = []
    for start in range(0, n, CHUNK):
        sims = unit[start : start + CHUNK] @ unit.t()
        sims[torch.arange(sims.shape[0]), torch.arange(start, start + sims.shape[0])] = -float("inf")
        scores.append(sims.topk(k, dim=1).values.mean(dim=1))
    return torch.cat(scores)
