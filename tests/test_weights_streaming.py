"""WEIGHTS_INIT, resume and conversion never hold the whole model (issue 10): each reads one
tensor (or one unit) at a time and the conversion streams its output file.

The memory tests measure the peak RSS of real gloo ranks (anonymous and file-backed pages, so a
memory-mapped file counts for what was touched) against a 129 MiB model of 32 units: holding the
whole model at once, as a state dict or as mapped file pages, exceeds the bounds by about the
model's size. The ranks are forked from a fresh interpreter (one for the four measurements, each
job from its own fork of it), not from pytest's process, whose earlier tests' memory would blur
their RSS by up to half the model. glibc's malloc is told to give every block of 64 KiB or more its own mapping, so
the RSS follows the live tensors (by default freed unit buffers may stay in the heap and blur the
peak by up to half the model). The other tests check that the results are bit for bit those of
the in-memory path.
"""

import ctypes
import gc
import os
import subprocess
import sys
import zipfile
from collections import OrderedDict
from pathlib import Path

import pytest
import torch
from torch import nn

from vistrain.checkpoint import (
    CheckpointError,
    consolidate,
    consolidated_state_dict,
    load_pretrained,
    load_sharded_checkpoint,
    save_sharded_checkpoint,
)
from vistrain.checkpoint.tensor_file import TensorFile, save_streamed
from vistrain.distributed.testing import run_on_ranks
from vistrain.fsdp import auto_wrap, by_class
from vistrain.fsdp.deferred_init import build_on_meta
from vistrain.fsdp.memory import current_rss_mib, peak_rss_since_reset_mib, reset_peak_rss
from vistrain.methods import load_config
from vistrain.runtime.host_memory import set_mmap_threshold

TESTS = Path(__file__).resolve().parent
WIDTH, DEPTH = 1024, 32  # 32 units of 4 MiB: 129 MiB of weights
MODEL_MIB = DEPTH * (WIDTH * WIDTH + 5 * WIDTH) * 4 / 2**20


class Layer(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(WIDTH, WIDTH)
        self.norm = nn.BatchNorm1d(WIDTH)

    def forward(self, x):
        return self.norm(self.linear(x))


class Tower(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.Sequential(*[Layer() for _ in range(DEPTH)])

    def forward(self, x):
        return self.layers(x)


def _sharded(weights: str = ""):
    """Tower built on the meta device, each Layer a unit created unit by unit by auto_wrap."""
    torch.manual_seed(0)
    model = build_on_meta(Tower)
    if weights:
        cfg = load_config(["config=test/simclr_tiny"]).MODEL.WEIGHTS_INIT.clone()
        cfg.defrost()
        cfg.PARAMS_FILE = weights
        load_pretrained(model, cfg)
    return auto_wrap(model, by_class([Layer]))


def _local_state(model, optimizer):
    shards = [p.detach().clone() for p in model.parameters()]
    # a parameter this rank holds no element of has (empty or no) state: nothing to compare
    return shards, [optimizer.state[p]["momentum_buffer"].clone() for p in model.parameters() if p.numel()]


def _save_worker(rank, world, run_dir):
    model = _sharded()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(4, WIDTH)).square().mean().backward()
    optimizer.step()
    path = save_sharded_checkpoint(run_dir, 1, model, optimizer, {"seen": torch.tensor(rank)}, {}, 0)
    full = model.state_dict()  # gathered by the engine: the reference, independent of the reader
    return path, full if rank == 0 else None, _local_state(model, optimizer)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """(checkpoint folder saved by 2 ranks, the same weights as one plain .pt file, each rank's
    shards and momentum when it saved)."""
    root = tmp_path_factory.mktemp("tower")
    results = run_on_ranks(_save_worker, 2, str(root / "run"))
    weights = str(root / "model.pt")
    torch.save(results[0][1], weights)
    return results[0][0], weights, [local for _, _, local in results]


def _peak_growth(prepare, step):
    """(MiB the RSS rose above its level before ``step(prepare())``, at its highest; the result).

    Run twice, the second measured: the first run faults in the pages of torch's code it uses (a
    forked process shares them with its parent but maps them only when it first runs them).
    """
    set_mmap_threshold(1 / 16)  # 64 KiB, fixed: a freed block is gone
    libc = ctypes.CDLL("libc.so.6")
    for _ in range(2):
        arg, result = prepare(), None
        gc.collect()
        libc.malloc_trim(0)  # drop free heap pages, also those inherited from the forking parent
        before = current_rss_mib()
        reset_peak_rss()
        result = step(arg)
        growth = peak_rss_since_reset_mib() - before
    return growth, result


_FRESH_PROCESS = """
import sys, torch
sys.path.insert(0, {tests!r})
import test_weights_streaming as t
from fork_each import fork_each
from vistrain.distributed.testing import run_on_ranks

def job(name, world, args, out):
    torch.save(run_on_ranks(getattr(t, name), world, *args), out)

fork_each([(n, lambda n=n, w=w, a=a, o=o: job(n, w, a, o)) for n, w, a, o in {jobs!r}])
"""


def _in_fresh_process(folder: Path, jobs):
    """Each ``(worker, world, args)`` of ``jobs`` as ``run_on_ranks(worker, world, *args)`` under
    one new interpreter (one torch start-up for all), each from its own fork of it; their results."""
    runs = [
        (worker.__name__, world, args, str(folder / f"{i}.pt"))
        for i, (worker, world, args) in enumerate(jobs)
    ]
    path = os.pathsep.join([str(TESTS.parent), os.environ.get("PYTHONPATH", "")])
    proc = subprocess.run(
        [sys.executable, "-c", _FRESH_PROCESS.format(tests=str(TESTS), jobs=runs)],
        env={**os.environ, "PYTHONPATH": path},
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [torch.load(out, weights_only=True) for _, _, _, out in runs]


@pytest.fixture(scope="module")
def measured(saved, tmp_path_factory):
    """The ranks' peak RSS growth and results of WEIGHTS_INIT from the file and from the folder, of
    resume and of consolidate (writing ``c.pt`` in the returned folder), measured in one fresh
    interpreter."""
    checkpoint, weights, _ = saved
    folder = tmp_path_factory.mktemp("measured")
    jobs = [
        (_init_worker, 2, (weights,)),
        (_init_worker, 2, (checkpoint,)),
        (_resume_worker, 2, (checkpoint,)),
        (_consolidate_worker, 1, (checkpoint, str(folder / "c.pt"))),
    ]
    init_file, init_folder, resume, consolidated = _in_fresh_process(folder, jobs)
    return {"file": init_file, "folder": init_folder, "resume": resume, "consolidate": consolidated}, folder


def _init_worker(rank, world, weights):
    growth, model = _peak_growth(lambda: None, lambda _: _sharded(weights))
    state = model.state_dict()  # collective; gathers the whole model (after measuring)
    return growth, state if rank == 0 else None


@pytest.mark.parametrize("form", ["file", "folder"])
def test_weights_init_reads_unit_by_unit(saved, measured, form):
    _, weights, _ = saved
    results = measured[0][form]
    expected = torch.load(weights, weights_only=True)
    state = results[0][1]
    assert state.keys() == expected.keys()
    assert all(torch.equal(state[k], v) and state[k].dtype == v.dtype for k, v in expected.items())
    # A rank keeps its shards (half the model) and holds one unit's weights at a time; the
    # whole file, loaded or mapped, would add MODEL_MIB.
    for growth, _ in results:
        assert growth < MODEL_MIB / 2 + 0.3 * MODEL_MIB, growth


def _resume_worker(rank, world, checkpoint):
    def prepare():
        model = _sharded()
        return model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)

    def resume(training):
        return training, load_sharded_checkpoint(checkpoint, *training)

    growth, ((model, optimizer), state) = _peak_growth(prepare, resume)
    return growth, _local_state(model, optimizer), state["extra"]


def test_resume_reads_only_this_ranks_slices(saved, measured):
    _, _, saved_local = saved
    results = measured[0]["resume"]
    for rank, (growth, (shards, momentum), extra) in enumerate(results):
        assert all(torch.equal(a, b) for a, b in zip(shards, saved_local[rank][0]))
        assert all(torch.equal(a, b) for a, b in zip(momentum, saved_local[rank][1]))
        assert torch.equal(extra["seen"], torch.tensor(rank))
        # the new momentum buffers are half the model; the rank file's weights and momentum,
        # mapped or loaded, would add another MODEL_MIB
        assert growth < MODEL_MIB / 2 + 0.3 * MODEL_MIB, growth


def _consolidate_worker(rank, world, checkpoint, out):
    return _peak_growth(lambda: None, lambda _: consolidate(checkpoint, out))[0]


def test_consolidate_streams_its_output(saved, measured):
    checkpoint, weights, _ = saved
    out = str(measured[1] / "c.pt")
    (growth,) = measured[0]["consolidate"]
    assert growth < 0.3 * MODEL_MIB, growth  # one tensor at a time, not the model (MODEL_MIB)
    written, expected = torch.load(out, weights_only=True), torch.load(weights, weights_only=True)
    in_memory = consolidated_state_dict(checkpoint)  # the path that holds the whole model
    assert list(written) == list(in_memory) and written.keys() == expected.keys()
    for key, value in expected.items():
        assert torch.equal(written[key], value) and torch.equal(in_memory[key], value), key
        assert written[key].dtype == value.dtype == in_memory[key].dtype
    Tower().load_state_dict(written)
    assert not os.path.exists(out + ".tmp")


def test_tensor_file_reads_any_tensor_and_range_of_a_file(tmp_path):
    base = torch.arange(40, dtype=torch.float32)
    obj = {
        "bf16": torch.randn(3, 5).to(torch.bfloat16),
        "int": torch.arange(7),
        "scalar": torch.tensor(2.5),
        "empty": torch.zeros(0, 4),
        "slice": base[10:20],  # saved with its whole storage, at an offset
        "strided": base.view(8, 5).t(),  # not contiguous
        "nested": {"list": [torch.ones(2), 3], "x": 1.5},
    }
    legacy = str(tmp_path / "legacy.pt")
    torch.save(obj, tmp_path / "zip.pt")
    torch.save(obj, legacy, _use_new_zipfile_serialization=False)
    zipped = TensorFile(str(tmp_path / "zip.pt"))
    for path in (str(tmp_path / "zip.pt"), legacy):
        tf = TensorFile(path)
        assert tf.streamed == (path != legacy)  # legacy files are loaded whole
        values = tf.materialize(tf.obj)
        for key in ("bf16", "int", "scalar", "empty", "slice", "strided"):
            assert values[key].dtype == obj[key].dtype and torch.equal(values[key], obj[key]), key
        assert torch.equal(values["nested"]["list"][0], torch.ones(2)) and values["nested"]["x"] == 1.5
        out = torch.zeros(4, dtype=torch.float64)  # a range, converted to the output's dtype
        tf.read_into(tf.obj["slice"], 3, out)
        assert torch.equal(out, torch.arange(13, 17, dtype=torch.float64))
    with pytest.raises(CheckpointError, match="elements"):
        zipped.read_into(zipped.obj["int"], 5, torch.zeros(3, dtype=torch.int64))


def test_streamed_save_is_a_plain_torch_file_and_atomic(tmp_path):
    values = OrderedDict([("a", torch.randn(300, 7)), ("b", torch.arange(5)), ("c", torch.randn(2).half())])
    specs = OrderedDict((k, (tuple(v.shape), v.dtype)) for k, v in values.items())
    path = str(tmp_path / "out.pt")
    save_streamed(path, specs, lambda k: values[k])
    for mmap in (False, True):
        loaded = torch.load(path, weights_only=True, mmap=mmap)
        assert list(loaded) == list(values)
        assert all(torch.equal(loaded[k], v) and loaded[k].dtype == v.dtype for k, v in values.items())
    with zipfile.ZipFile(path) as archive:  # a zip like torch.save's (tensor CRCs left at 0)
        assert sum(name.split("/", 1)[1].startswith("data/") for name in archive.namelist()) == 3

    def fails_half_way(key):
        if key == "c":
            raise OSError("disk full")
        return values[key] * 2

    with pytest.raises(OSError, match="disk full"):
        save_streamed(path, specs, fails_half_way)
    assert torch.equal(torch.load(path, weights_only=True)["a"], values["a"])  # the old file
    assert os.listdir(tmp_path) == ["out.pt"]
    with pytest.raises(ValueError, match="announced"):
        save_streamed(path, specs, lambda k: values[k].float())


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
