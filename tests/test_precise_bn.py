"""BENCHMARK.TRUNK_BN_STATS: recompute: the frozen trunk's BatchNorm statistics averaged over a
pass of the training images (vistrain/benchmarks/precise_bn.py).

Checked against the formula written out by hand (one process), 2 gloo ranks against one process
holding the same global batches, and the evaluation engines' trunk against a pass by hand.
"""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from vistrain.benchmarks import common
from vistrain.benchmarks.precise_bn import batch_norms, recompute_bn_statistics
from vistrain.config import ConfigError
from vistrain.distributed.testing import run_on_ranks
from vistrain.jobs import check_values
from vistrain.methods import load_config

CPU = torch.device("cpu")


def _net() -> nn.Module:
    torch.manual_seed(0)
    net = nn.Sequential(
        nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Conv2d(4, 5, 3), nn.BatchNorm2d(5)
    )
    with torch.no_grad():
        for norm in batch_norms(net):
            norm.weight.uniform_(0.5, 1.5)
            norm.bias.uniform_(-0.5, 0.5)
            norm.running_mean.fill_(7.0)  # what a checkpoint carried: must not survive
            norm.running_var.fill_(9.0)
    return net


def _batches(count=3, size=6):
    torch.manual_seed(1)
    return [torch.randn(size, 3, 8, 8) * 2 + 0.5 for _ in range(count)]


def _by_hand(net, batches):
    """(mean, unbiased var) of each BatchNorm's input, per batch, with every BatchNorm of the pass
    normalising by its batch's own statistics: the formula of the module docstring, averaged."""
    conv1, bn1, _, conv2, bn2 = net
    stats = {0: [], 1: []}
    for x in batches:
        h1 = conv1(x)
        stats[0].append((h1.mean((0, 2, 3)), h1.var((0, 2, 3), unbiased=True)))
        normed = F.batch_norm(h1, None, None, bn1.weight, bn1.bias, training=True, eps=bn1.eps)
        h2 = conv2(F.relu(normed))
        stats[1].append((h2.mean((0, 2, 3)), h2.var((0, 2, 3), unbiased=True)))
    return [
        (torch.stack([m for m, _ in stats[i]]).mean(0), torch.stack([v for _, v in stats[i]]).mean(0))
        for i in (0, 1)
    ]


@torch.no_grad()
def test_statistics_are_the_average_of_the_batches_statistics():
    net, batches = _net(), _batches()
    expected = _by_hand(net, batches)
    momenta = [norm.momentum for norm in batch_norms(net)]
    net = recompute_bn_statistics(net, iter(batches))
    norms = batch_norms(net)
    for norm, (mean, var) in zip(norms, expected):
        torch.testing.assert_close(norm.running_mean, mean, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(norm.running_var, var, rtol=1e-5, atol=1e-6)
        assert int(norm.num_batches_tracked) == 3
    assert [norm.momentum for norm in norms] == momenta  # put back
    assert not net.training


def _recompute_on_ranks(rank, world_size, batches):
    """Rank r takes images r, r + W, ... of each global batch (a DistributedSampler's share)."""
    net = recompute_bn_statistics(_net(), (x[rank::world_size] for x in batches))
    return [(norm.running_mean, norm.running_var) for norm in batch_norms(net)]


def test_ranks_reach_the_statistics_of_the_global_batches():
    """2 ranks holding halves of each global batch end where one process holding the whole batches
    does, the same on both ranks; the last batch, of one image, leaves rank 1 nothing."""
    batches = [*_batches(count=2, size=6), _batches(count=1, size=1)[0]]
    one = batch_norms(recompute_bn_statistics(_net(), iter(batches)))
    for rank in run_on_ranks(_recompute_on_ranks, 2, batches):
        for (mean, var), norm in zip(rank, one):
            torch.testing.assert_close(mean, norm.running_mean, rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(var, norm.running_var, rtol=1e-5, atol=1e-6)


def _tiny(*overrides):
    return load_config(
        [
            "config=test/benchmark_tiny",
            "config.CHECKPOINT.DIR=unused",
            "config.MODEL.FSDP_CONFIG.AUTO_SETUP_FSDP=False",
            *overrides,
        ]
    )


def test_the_frozen_trunk_gets_the_statistics_of_the_training_images():
    """build_frozen_trunk with recompute: the statistics of a pass over DATA.TRAIN in order with
    the feature views, for a random trunk (whose init statistics, 0 and 1, standardise nothing)."""
    cfg = _tiny("config.BENCHMARK.TRUNK_BN_STATS=recompute", "config.BENCHMARK.FEATURE_VIEWS=flip")
    torch.manual_seed(0)
    trunk, _ = common.build_frozen_trunk(cfg, CPU)
    torch.manual_seed(0)  # the same random trunk
    plain, _ = common.build_frozen_trunk(_tiny("config.BENCHMARK.FEATURE_VIEWS=flip"), CPU)
    loader = common.ordered_loader(cfg.DATA, "TRAIN", cfg.SEED_VALUE, CPU)
    images = [x for x, _ in common.one_view_batches(loader, CPU)]
    by_hand = recompute_bn_statistics(plain, (view for x in images for view in (x, x.flip(3))))
    pairs = list(zip(batch_norms(trunk), batch_norms(by_hand)))
    assert len(pairs) > 2 and not trunk.training
    for norm, expected in pairs:
        torch.testing.assert_close(norm.running_mean, expected.running_mean)
        torch.testing.assert_close(norm.running_var, expected.running_var)
        assert int(norm.num_batches_tracked) == 2 * len(loader)
    assert not torch.allclose(pairs[0][0].running_var, torch.ones_like(pairs[0][0].running_var))


def test_an_unknown_trunk_bn_setting_is_refused_in_one_line():
    with pytest.raises(
        ConfigError, match="BENCHMARK.TRUNK_BN_STATS must be one of recompute, running; got 'precise'"
    ):
        check_values(_tiny("config.BENCHMARK.TRUNK_BN_STATS=precise"))


def _extract_on_ranks(rank, world_size, argv):
    from vistrain.benchmarks import extract_features

    extract_features(load_config(argv))


def test_sharded_ranks_extract_with_the_statistics_of_one_process(tmp_path):
    """extract_features with recompute on 2 gloo ranks, the trunk sharded by our engine (4 TRAIN
    images per rank and batch), writes the test features one unsharded process computes with the
    same global batches of 8."""
    plain = [
        "config=test/benchmark_tiny",
        "config.JOB=extract_features",
        "config.BENCHMARK.FEATURE_VIEWS=flip",
    ]
    argv = [*plain, "config.BENCHMARK.TRUNK_BN_STATS=recompute"]
    run_on_ranks(_extract_on_ranks, 2, [*argv, f"config.CHECKPOINT.DIR={tmp_path / '2'}"])
    one = [
        *argv,
        f"config.CHECKPOINT.DIR={tmp_path / '1'}",
        "config.MODEL.FSDP_CONFIG.AUTO_SETUP_FSDP=False",
        "config.DATA.TRAIN.BATCHSIZE_PER_REPLICA=8",
    ]
    run_on_ranks(_extract_on_ranks, 1, one)
    run_on_ranks(_extract_on_ranks, 2, [*plain, f"config.CHECKPOINT.DIR={tmp_path / 'running'}"])
    written = {
        run: torch.load(tmp_path / run / "features" / "test.pt", weights_only=True)["features"]
        for run in ("2", "1", "running")
    }
    for name, feature in written["1"].items():
        torch.testing.assert_close(written["2"][name], feature, rtol=1e-5, atol=1e-5)
        assert not torch.allclose(written["running"][name], feature, atol=1e-3)  # the statistics matter
