"""Weighted k-nearest-neighbour evaluation of a frozen trunk: ``knn(cfg)`` (``JOB: knn``).

Wu et al., "Unsupervised Feature Learning via Non-Parametric Instance Discrimination" (2018), as
used by DINO: with L2-normalised features, a test image ``q`` is compared with every training
image ``x_i`` by cosine similarity ``s_i = q . x_i``; its ``k`` most similar neighbours vote for
their labels with weight ``exp(s_i / T)``, and the classes are ranked by total vote:

    score_c(q) = sum_{i in topk(q)} exp(s_i / T) * [y_i == c]

The maths lives in pure functions (:func:`knn_class_scores`, :func:`knn_topk_hits`); test
images are scored ``KNN_CHUNK_SIZE`` at a time, so memory is O(chunk x N_train), not
O(N_test x N_train). Multi-rank: every rank extracts its part of both splits; the training bank
is gathered on every rank (de-duplicated and sorted by data set index, so it equals the
single-process bank exactly), each rank scores its own test images, and the de-duplicated hit
counts are summed. The bank is every labelled TRAIN image once (read in order, nothing dropped);
with ``DATA.TRAIN.LABEL_FRACTION`` that stratified part of TRAIN only. Results go to the log,
TensorBoard (``knn/<feature>/top1``) and
``CHECKPOINT.DIR/metrics.json``.
"""

import time
from typing import Dict, Sequence, Tuple

import torch
import torch.nn.functional as F

from vistrain.benchmarks import common, label_fraction
from vistrain.config.words import plural
from vistrain.data import build_loader
from vistrain.distributed import comm
from vistrain.runtime.logger import RunWriter, logger
from vistrain.runtime.precision import amp_dtype
from vistrain.runtime.run_setup import record_config, start_run
from vistrain.runtime.tracking import wandb_settings

# --------------------------------------------------------------------------------------------
# pure maths


def knn_class_scores(
    queries: torch.Tensor,
    bank: torch.Tensor,
    bank_labels: torch.Tensor,
    num_classes: int,
    k: int,
    temperature: float,
) -> torch.Tensor:
    """Vote of the ``k`` nearest bank entries for each query.

    Args:
        queries: (Q, D) float, L2-normalised rows.
        bank: (N, D) float, L2-normalised rows (the training set).
        bank_labels: (N,) int64 in [0, num_classes).
        k: neighbours voting (capped at N); temperature: T in ``exp(sim / T)``.
    Returns:
        (Q, num_classes) float scores ``sum_{i in topk} exp(s_i / T) [y_i == c]``.
    """
    sims = queries @ bank.T  # (Q, N) cosine similarities
    top_sims, top_idx = sims.topk(min(k, bank.shape[0]), dim=1)  # (Q, k)
    weights = (top_sims / temperature).exp()
    scores = torch.zeros(queries.shape[0], num_classes, dtype=weights.dtype, device=queries.device)
    return scores.scatter_add_(1, bank_labels[top_idx], weights)


def knn_topk_hits(
    queries: torch.Tensor,
    labels: torch.Tensor,
    bank: torch.Tensor,
    bank_labels: torch.Tensor,
    num_classes: int,
    k: int,
    temperature: float,
    chunk_size: int,
    ks: Sequence[int] = (1, 5),
) -> torch.Tensor:
    """Bool (Q, len(ks)): the true label (Q,) is among the top-k voted classes, scored in chunks."""
    if chunk_size < 1:
        raise ValueError(f"BENCHMARK.KNN_CHUNK_SIZE must be >= 1, got {chunk_size}")
    hits = [torch.zeros(0, len(ks), dtype=torch.bool, device=queries.device)]
    for lo in range(0, queries.shape[0], chunk_size):
        scores = knn_class_scores(
            queries[lo : lo + chunk_size], bank, bank_labels, num_classes, k, temperature
        )
        hits.append(common.topk_correct(scores, labels[lo : lo + chunk_size], ks))
    return torch.cat(hits)


def build_bank(
    features: torch.Tensor, labels: torch.Tensor, indices: torch.Tensor
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Collective: this rank's training features (N_r, D), labels and data set indices (N_r,) ->
    the de-duplicated bank of all ranks, rows sorted by index: ((N, D), (N,)), equal on all ranks."""
    _, (features, labels) = common.gather_unique(indices, features, labels)
    return features, labels


def knn_counts(hits: torch.Tensor, test_indices: torch.Tensor) -> torch.Tensor:
    """Collective: float64 [top-1 hits, top-5 hits, images] over every rank's test images, each
    once; ``hits`` (Q, 2) from :func:`knn_topk_hits`, ``test_indices`` (Q,) their data set indices."""
    keep = common.unique_on_this_rank(test_indices)
    counts = torch.zeros(3, dtype=torch.float64, device=hits.device)
    counts[:2] = hits[keep].sum(dim=0).to(torch.float64)
    counts[2] = keep.sum()
    return comm.all_reduce_sum(counts)


# --------------------------------------------------------------------------------------------
# the engine


def knn(cfg) -> None:
    """k-NN top-1/top-5 on DATA.TEST with DATA.TRAIN as the neighbour bank, per BENCHMARK.FEATURES."""
    start = time.perf_counter()
    bench = cfg.BENCHMARK
    device = start_run(cfg)

    loaders = {"TRAIN": label_fraction.labelled_train_loader(_bank_config(cfg), device)[0]}
    loaders["TEST"] = build_loader(cfg.DATA, "TEST", seed=cfg.SEED_VALUE, device=device)
    num_classes = common.num_classes(loaders["TRAIN"].dataset, loaders["TEST"].dataset)
    trunk, dims = common.build_frozen_trunk(cfg, device)
    record_config(cfg)  # built and loaded: the job really starts
    names = list(dims)
    pool, dtype, views = bench.POOL_SIZE, amp_dtype(cfg.MODEL), bench.FEATURE_VIEWS
    train_feats, train_labels, train_indices = common.extract(
        trunk, loaders["TRAIN"], names, pool, dtype, device, views
    )
    test_feats, test_labels, test_indices = common.extract(
        trunk, loaders["TEST"], names, pool, dtype, device, views
    )
    logger.info(
        f"kNN (k={bench.KNN_K}, T={bench.KNN_TEMPERATURE}) on {names}, {plural(num_classes, 'class', 'classes')}"
    )

    results = {}
    for name in names:
        bank, bank_labels = build_bank(F.normalize(train_feats[name], dim=1), train_labels, train_indices)
        queries = F.normalize(test_feats[name], dim=1)
        hits = knn_topk_hits(
            queries, test_labels, bank, bank_labels, num_classes, bench.KNN_K, bench.KNN_TEMPERATURE,
            bench.KNN_CHUNK_SIZE,
        )  # fmt: skip
        counts = knn_counts(hits, test_indices)
        results.update(common.summarise(counts[None], [name]))
        results[name]["bank_size"] = bank.shape[0]
    _report(cfg, results, time.perf_counter() - start)


def _bank_config(cfg):
    """``cfg`` with DATA.TRAIN read in order, nothing dropped: every labelled image is in the bank
    once, however few they are (a label fraction) and whatever DROP_LAST training would use."""
    bank = cfg.clone()
    bank.defrost()
    bank.DATA.TRAIN.SHUFFLE = bank.DATA.TRAIN.DROP_LAST = False
    bank.freeze()
    return bank


def _report(cfg, results: Dict[str, dict], seconds: float) -> None:
    common.log_accuracy_table(
        f"kNN on DATA.TEST ({cfg.MODEL.WEIGHTS_INIT.PARAMS_FILE or 'random init'}):", results
    )
    record = {
        "engine": "knn",
        "weights": cfg.MODEL.WEIGHTS_INIT.PARAMS_FILE,
        "k": cfg.BENCHMARK.KNN_K,
        "temperature": cfg.BENCHMARK.KNN_TEMPERATURE,
        "world_size": comm.get_world_size(),
        "results": results,
        **label_fraction.record(cfg, next(iter(results.values()))["bank_size"]),
        "total_seconds": seconds,
    }
    path = common.write_metrics(cfg.CHECKPOINT.DIR, record)
    if comm.is_main_process():
        with RunWriter(cfg.CHECKPOINT.DIR, wandb_settings(cfg)) as writer:
            for name, res in results.items():
                writer.add_scalar(f"knn/{name}/top1", res["top1"], 0)
                writer.add_scalar(f"knn/{name}/top5", res["top5"], 0)
    logger.info(f"wrote {path}")
