"""CPUSyncBatchNorm on real gloo ranks equals nn.BatchNorm2d over the concatenated global batch."""

import pytest
import torch
from torch import nn

from vistrain.distributed.sync_batchnorm import (
    CPUSyncBatchNorm,
    convert_sync_batchnorm,
    sync_bn_group_ranks,
    sync_bn_process_group,
)
from vistrain.distributed.testing import run_on_ranks

C = 3


def _global_batch(sizes, dtype=torch.float64, seed=0):
    """Inputs (sum(sizes), C, 4, 5) with a non-zero mean, cotangents, and BN weight/bias."""
    gen = torch.Generator().manual_seed(seed)
    n = sum(sizes)
    x = (torch.randn(n, C, 4, 5, generator=gen, dtype=torch.float64) * 2 + 3).to(dtype)
    # Rounded to dtype: the cotangent a low-precision output receives is rounded the same way.
    dy = torch.randn(n, C, 4, 5, generator=gen, dtype=torch.float64).to(dtype).double()
    weight = torch.rand(C, generator=gen, dtype=torch.float64) + 0.5
    bias = torch.randn(C, generator=gen, dtype=torch.float64)
    return x, dy, weight, bias


def _make_bn(weight, bias, momentum=0.1, dtype=torch.float64):
    bn = nn.BatchNorm2d(C, momentum=momentum).to(dtype)
    with torch.no_grad():
        bn.weight.copy_(weight)
        bn.bias.copy_(bias)
    return bn


def _slice(t, sizes, rank):
    start = sum(sizes[:rank])
    return t[start : start + sizes[rank]]


def _run_bn(bn, x, dy, steps):
    """``steps`` training forwards (running stats move each time); grads of the last one."""
    for _ in range(steps):
        x_in = x.clone().requires_grad_(True)
        bn.zero_grad()
        y = bn(x_in)
        (y.double() * dy).sum().backward()
    return {
        "y": y.detach(),
        "dx": x_in.grad,
        "dw": bn.weight.grad,
        "db": bn.bias.grad,
        "mean": bn.running_mean.clone(),
        "var": bn.running_var.clone(),
        "nbt": bn.num_batches_tracked.clone(),
    }


def _laid_out(x, dy, layout):
    """(N, C, 4, 5) inputs as the layout a test asks for: "nchw", "channels_last" or "nc" (N, C)."""
    if layout == "nc":
        return x[:, :, 0, 0].contiguous(), dy[:, :, 0, 0].contiguous()
    if layout == "channels_last":
        return x.contiguous(memory_format=torch.channels_last), dy
    return x, dy


def _sync_worker(rank, world, sizes, dtype_name, momentum, steps, group_size, layout="nchw"):
    dtype = getattr(torch, dtype_name)
    x, dy, weight, bias = _global_batch(sizes, dtype)
    x, dy = _laid_out(x, dy, layout)
    group = sync_bn_process_group(group_size)
    param_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    bn = convert_sync_batchnorm(_make_bn(weight, bias, momentum, param_dtype), group)
    assert isinstance(bn, CPUSyncBatchNorm)
    return _run_bn(bn, _slice(x, sizes, rank), _slice(dy, sizes, rank), steps)


def _reference(sizes, dtype=torch.float64, momentum=0.1, steps=2, layout="nchw"):
    x, dy, weight, bias = _global_batch(sizes, dtype)
    if layout == "nc":  # BatchNorm2d takes 4-D input only; the functional form is the same for (N, C)
        x, dy = _laid_out(x, dy, layout)
        bn = _make_bn(weight, bias, momentum)
        bn._check_input_dim = lambda input: None
        return _run_bn(bn, x.double(), dy, steps)
    # Reference statistics in float64 from the (possibly bf16-rounded) inputs.
    return _run_bn(_make_bn(weight, bias, momentum), x.double(), dy, steps)


def _check_against(results, ref, tol):
    for key in ("y", "dx"):
        got = torch.cat([r[key].double() for r in results])
        torch.testing.assert_close(got, ref[key], atol=tol, rtol=tol, msg=key)
    for key in ("dw", "db"):  # DDP sums (averages) the per-rank parameter grads
        got = sum(r[key].double() for r in results)
        torch.testing.assert_close(got, ref[key], atol=tol, rtol=tol, msg=key)
    for r in results:
        for key in ("mean", "var", "nbt"):
            torch.testing.assert_close(r[key].double(), ref[key].double(), atol=tol, rtol=tol, msg=key)


@pytest.mark.parametrize("sizes", [[2, 2], [1, 3, 2], [4, 0, 1]])
def test_sync_bn_matches_global_batchnorm(sizes):
    results = run_on_ranks(_sync_worker, len(sizes), sizes, "float64", 0.1, 2, 0)
    _check_against(results, _reference(sizes), tol=1e-10)


@pytest.mark.parametrize("layout", ["channels_last", "nc"])
def test_sync_bn_channels_last_and_flat_inputs(layout):
    sizes = [3, 2]
    results = run_on_ranks(_sync_worker, 2, sizes, "float64", 0.1, 2, 0, layout)
    _check_against(results, _reference(sizes, layout=layout), tol=1e-10)
    if layout == "channels_last":  # the next convolution gets the layout it was given
        assert all(r["y"].is_contiguous(memory_format=torch.channels_last) for r in results)


def test_sync_bn_float32_and_cumulative_momentum():
    sizes = [3, 2]
    results = run_on_ranks(_sync_worker, 2, sizes, "float32", None, 3, 0)
    _check_against(results, _reference(sizes, momentum=None, steps=3), tol=2e-5)


def test_sync_bn_bf16_input_has_fp32_statistics():
    sizes = [6, 5]
    results = run_on_ranks(_sync_worker, 2, sizes, "bfloat16", 0.5, 1, 0)
    ref = _reference(sizes, dtype=torch.bfloat16, momentum=0.5, steps=1)
    for r in results:
        assert r["y"].dtype == torch.bfloat16 and r["dx"].dtype == torch.bfloat16
        # Statistics accumulated in fp32: far tighter than bf16's ~4e-3 resolution.
        torch.testing.assert_close(r["mean"].double(), ref["mean"], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(r["var"].double(), ref["var"], atol=1e-5, rtol=1e-5)
    for key in ("y", "dx"):  # bf16 outputs: within bf16 rounding of the exact values
        got = torch.cat([r[key].double() for r in results])
        torch.testing.assert_close(got, ref[key], atol=0.02, rtol=0.01)
    for key in ("dw", "db"):  # fp32 parameter grads from fp32 sums
        torch.testing.assert_close(sum(r[key].double() for r in results), ref[key], atol=1e-4, rtol=1e-4)


def test_sync_bn_group_size_two_syncs_within_pairs():
    sizes = [2, 3, 1, 4]
    results = run_on_ranks(_sync_worker, 4, sizes, "float64", 0.1, 1, 2)
    x, dy, weight, bias = _global_batch(sizes)
    for pair in ([0, 1], [2, 3]):
        lo, hi = sum(sizes[: pair[0]]), sum(sizes[: pair[1] + 1])
        ref = _run_bn(_make_bn(weight, bias), x[lo:hi], dy[lo:hi], 1)
        _check_against([results[i] for i in pair], ref, tol=1e-10)
    whole = _reference(sizes, steps=1)
    assert not torch.allclose(results[0]["mean"], whole["mean"])


def test_single_process_is_plain_batchnorm():
    x, dy, weight, bias = _global_batch([4])
    ref = _run_bn(_make_bn(weight, bias), x, dy, 2)
    got = _run_bn(convert_sync_batchnorm(_make_bn(weight, bias)), x, dy, 2)
    for key in ref:
        torch.testing.assert_close(got[key], ref[key])
    bn = CPUSyncBatchNorm(C).double().eval()
    torch.testing.assert_close(bn(x), x / (1 + 1e-5) ** 0.5)  # running stats (0, 1) in eval


def test_convert_keeps_structure_params_and_settings():
    model = nn.Sequential(
        nn.Conv2d(3, C, 1),
        nn.BatchNorm2d(C, eps=1e-3, momentum=0.3),
        nn.Sequential(nn.Flatten(), nn.BatchNorm1d(4, affine=False, track_running_stats=False)),
    )
    bn = model[1]
    bn.weight.requires_grad_(False)
    bn.running_mean.fill_(0.7)
    bn.num_batches_tracked.fill_(5)
    bn.eval()
    weight, conv = bn.weight, model[0]
    out = convert_sync_batchnorm(model)
    assert out is model and model[0] is conv and isinstance(model[2], nn.Sequential)
    new, new1d = model[1], model[2][1]
    assert type(new) is CPUSyncBatchNorm and type(new1d) is CPUSyncBatchNorm
    assert new.weight is weight and not new.weight.requires_grad and new.bias.requires_grad
    assert (new.eps, new.momentum, new.affine, new.track_running_stats) == (1e-3, 0.3, True, True)
    assert not new.training and new.running_mean[0] == 0.7 and new.num_batches_tracked == 5
    assert (new1d.affine, new1d.track_running_stats, new1d.running_mean) == (False, False, None)
    assert convert_sync_batchnorm(new) is new  # already synced: untouched
    assert set(model.state_dict()) == {
        "0.weight",
        "0.bias",
        "1.weight",
        "1.bias",
        "1.running_mean",
        "1.running_var",
        "1.num_batches_tracked",
    }


def test_sync_bn_rejects_1d_input():
    with pytest.raises(ValueError, match="expected input of shape"):
        CPUSyncBatchNorm(C)(torch.randn(C))


def test_group_ranks_arithmetic():
    assert sync_bn_group_ranks(4, 0) == [[0, 1, 2, 3]]
    assert sync_bn_group_ranks(8, 4) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert sync_bn_group_ranks(6, 2) == [[0, 1], [2, 3], [4, 5]]
    assert sync_bn_group_ranks(3, 1) == [[0], [1], [2]]
    assert sync_bn_group_ranks(1, 1) == [[0]]
    for world in range(1, 13):
        for k in range(1, world + 1):
            if world % k == 0:
                groups = sync_bn_group_ranks(world, k)
                assert sorted(r for g in groups for r in g) == list(range(world))
                assert all(len(g) == k for g in groups)
    with pytest.raises(ValueError, match="not divisible"):
        sync_bn_group_ranks(6, 4)
    with pytest.raises(ValueError, match="GROUP_SIZE"):
        sync_bn_group_ranks(4, -1)


def test_process_group_single_process_is_none():
    assert sync_bn_process_group(0) is None
    assert sync_bn_process_group(1) is None
