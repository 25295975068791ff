"""Pins the private torch/torchvision behaviour that vistrain.torch_compat relies on."""

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode
from torchvision.models import regnet_y_400mf
from torchvision.models.regnet import BlockParams

from vistrain.torch_compat import (
    BatchNormBase,
    NormBase,
    StageSettings,
    child_modules,
    fused_attention,
    meta_trunc_normal_refused,
    op_is_mutable,
    own_buffers,
    own_parameters,
    persistent_buffer_names,
    redispatch_torch_function,
    regnet_stage_settings,
    version_counter,
    view_base,
)


def test_batch_norm_base_covers_every_batch_norm():
    for cls in (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.SyncBatchNorm):
        assert issubclass(cls, BatchNormBase), cls
    assert not issubclass(nn.InstanceNorm2d, BatchNormBase)
    assert not issubclass(nn.LayerNorm, BatchNormBase)


def test_norm_base_covers_batch_and_instance_norm():
    for cls in (nn.BatchNorm2d, nn.SyncBatchNorm, nn.InstanceNorm2d):
        assert issubclass(cls, NormBase), cls


def test_regnet_stage_settings_match_torchvision_models():
    """RegNetY-400MF's published design (Radosavovic et al. 2020) and torchvision's own model."""
    params = BlockParams.from_init_params(depth=16, w_0=48, w_a=27.89, w_m=2.09, group_width=8, se_ratio=0.25)
    stages = regnet_stage_settings(params)
    assert all(isinstance(s, StageSettings) for s in stages)
    assert [s.width for s in stages] == [48, 104, 208, 440]
    assert [s.depth for s in stages] == [1, 3, 6, 6]
    assert [s.stride for s in stages] == [2, 2, 2, 2]
    assert {s.group_width for s in stages} == {8} and {s.bottleneck_multiplier for s in stages} == {1.0}
    built = regnet_y_400mf().trunk_output
    assert [len(stage) for stage in built] == [s.depth for s in stages]
    assert [stage[-1].f.c[0].out_channels for stage in built] == [s.width for s in stages]


def test_autograd_callback_runs_at_the_end_of_backward_and_backward_running_says_when():
    import torch

    from vistrain.torch_compat import backward_running, queue_autograd_callback

    seen = []
    x = torch.ones(2, requires_grad=True)
    y = x * 2

    def hook(grad):
        seen.append(("hook", backward_running()))
        queue_autograd_callback(lambda: seen.append(("end", backward_running())))
        return grad

    y.register_hook(hook)
    y.sum().backward()
    assert seen == [("hook", True), ("end", True)] and not backward_running()


def test_saved_tensors_hooks_are_visible_and_can_be_disabled():
    import torch

    from vistrain.torch_compat import current_saved_tensors_hooks, saved_tensors_hooks_enabled

    def pack(t):
        return t

    def unpack(t):
        return t

    assert current_saved_tensors_hooks() is None and saved_tensors_hooks_enabled()
    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        assert current_saved_tensors_hooks() == (pack, unpack)
    with torch.autograd.graph.disable_saved_tensors_hooks("no hooks here"):
        assert not saved_tensors_hooks_enabled()


def test_storage_id_identifies_storages_on_meta_and_the_dispatch_mode_sees_aten_calls():
    import torch

    from vistrain.torch_compat import TorchDispatchMode, storage_id, tree_flatten, tree_map

    a, b = torch.empty(4, device="meta"), torch.empty(4, device="meta")
    assert storage_id(a) == storage_id(a.detach()) == storage_id(a[1:]) != storage_id(b)
    seen = []

    class Mode(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen.append(func)
            return func(*args, **(kwargs or {}))

    with Mode():
        torch.empty(3, device="meta").uniform_()
    assert torch.ops.aten.uniform_.default in seen
    assert tree_map(lambda x: x * 2, ([1], {"k": 2})) == ([2], {"k": 4})
    assert tree_flatten(([1], {"k": 2}))[0] == [1, 2]


def test_meta_load_records_where_each_storage_starts_in_the_file(tmp_path):
    import torch

    from vistrain.torch_compat import storage_file_offset

    saved = {"a": torch.randn(5, 3), "b": torch.arange(4, dtype=torch.int16)}
    torch.save(saved, tmp_path / "x.pt")
    data = (tmp_path / "x.pt").read_bytes()
    for key, meta in torch.load(tmp_path / "x.pt", map_location="meta", weights_only=True).items():
        assert meta.is_meta and meta.shape == saved[key].shape and meta.dtype == saved[key].dtype
        offset = storage_file_offset(meta.untyped_storage())
        nbytes = saved[key].numel() * saved[key].element_size()
        assert data[offset : offset + nbytes] == saved[key].numpy().tobytes(), key
    assert storage_file_offset(torch.zeros(2).untyped_storage()) is None


def test_a_modules_own_registries_are_live_and_views_know_their_base():
    bn = nn.BatchNorm2d(3)
    bn.register_buffer("scratch", torch.zeros(1), persistent=False)
    assert set(own_parameters(bn)) == {"weight", "bias"} and "running_mean" in own_buffers(bn)
    assert persistent_buffer_names(bn) == ["running_mean", "running_var", "num_batches_tracked"]
    own_parameters(bn).pop("bias")  # live: the module no longer has it as a parameter
    assert [n for n, _ in bn.named_parameters()] == ["weight"]
    seq = nn.Sequential(nn.Linear(2, 2))
    child_modules(seq)["0"] = nn.Identity()
    assert isinstance(seq[0], nn.Identity)
    full = torch.zeros(6)
    assert view_base(full[2:4].view(2, 1)) is full and view_base(full) is None
    before = version_counter(full)
    torch._foreach_zero_([full])  # what optimizer.zero_grad(set_to_none=False) runs
    full.zero_()
    assert version_counter(full) == before + 2


def test_op_is_mutable_tells_in_place_aten_calls():
    assert op_is_mutable(torch.ops.aten.add_.Tensor) and not op_is_mutable(torch.ops.aten.add.Tensor)


def test_fused_attention_is_sdpa_and_a_mode_can_see_inside_a_torch_function():
    q, k, v = (torch.randn(2, 3, 5, 4) for _ in range(3))
    torch.testing.assert_close(fused_attention(q, k, v), F.scaled_dot_product_attention(q, k, v))
    meta = torch.empty(2, 3, 5, 4, device="meta")
    assert fused_attention(meta, meta, meta).shape == (2, 3, 5, 4)
    seen = []

    class Mode(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            seen.append(func)
            if func is F.multi_head_attention_forward:
                with self:
                    return redispatch_torch_function(func, types, args, kwargs or {})
            return func(*args, **(kwargs or {}))

    attention = nn.MultiheadAttention(4, 2, batch_first=True)
    x = torch.randn(2, 5, 4)
    with Mode():
        attention(x, x, x, need_weights=False)
    assert F.multi_head_attention_forward in seen and F.scaled_dot_product_attention in seen


def test_torchs_trunc_normal_goes_through_the_helper_we_replace():
    """Both ``nn.init.trunc_normal_`` and the name imported from ``torch.nn.init`` reach the
    replaced helper on a meta tensor; other tensors are filled as usual; the helper is restored."""
    from torch.nn.init import trunc_normal_

    seen = []
    with meta_trunc_normal_refused(seen.append):
        nn.init.trunc_normal_(torch.empty(3, device="meta"))
        trunc_normal_(torch.empty(2, device="meta"))
        filled = nn.init.trunc_normal_(torch.zeros(1000), std=0.02)
    assert [tuple(t.shape) for t in seen] == [(3,), (2,)]
    assert 0.015 < filled.std() < 0.025  # a = -2, b = 2: absolute bounds, far outside
    nn.init.trunc_normal_(torch.empty(3, device="meta"))
    assert len(seen) == 2
