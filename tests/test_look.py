"""Looking at a trained trunk (tools/look.py, vistrain/benchmarks/look/) and the pictures a run
draws: on one tiny SimCLR run (1 rank, 1 epoch, with the monitor) every picture is drawn and read
back (size, not blank, TensorBoard); a planted duplicate in an unlabelled folder tops
duplicates.csv; a timm ViT's class-token attention equals the weights its own attention computes;
monitor.png draws every numeric series of the monitor's records. (Embeddings on 1 and 2 ranks:
tests/test_benchmarks.py, test_extract_features_merged_file_is_the_same_on_any_world_size.)"""

import csv
import importlib.util
import shutil
from pathlib import Path

import numpy as np
import pytest
import timm
import torch
from PIL import Image

from vistrain.benchmarks import look
from vistrain.benchmarks.look import attention, similarity
from vistrain.distributed.testing import run_on_ranks
from vistrain.methods import load_config
from vistrain.runtime import pictures
from vistrain.training.trainer import train

REPO = Path(__file__).resolve().parents[1]
RUN = [
    "config=test/simclr_tiny",
    "config.OPTIMIZER.num_epochs=1",
    "config.DATA.TRAIN.DATA_LIMIT=20",  # 5 iterations of 4 images, 10 classes
    "config.MONITOR.EVERY_EPOCHS=1",
    "config.DATA.TEST.SYNTHETIC_SIZE=20",  # the monitor's kNN test images
]
SMALL = ["config.LOOK.THUMBNAILS=5", "config.LOOK.QUERIES=3", "config.LOOK.NEIGHBOURS=4"]


def _train(rank, world_size, argv):
    train(load_config(argv))


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    """A finished run folder: the tiny RegNet trained one epoch on one rank (20 synthetic images
    of 10 classes), its config.yaml, checkpoint, views.png and monitor.png."""
    run_dir = tmp_path_factory.mktemp("look") / "run"
    run_on_ranks(_train, 1, [*RUN, f"config.CHECKPOINT.DIR={run_dir}"])
    return run_dir


def _not_blank(path) -> np.ndarray:
    with Image.open(path) as image:
        pixels = np.asarray(image.convert("RGB"))
    assert len(np.unique(pixels.reshape(-1, 3), axis=0)) > 50, f"{path} is nearly blank"
    return pixels


def test_every_picture_of_a_tiny_run(tiny_run, one_thread):
    """map, neighbours, attention (a CNN: the norm of each stage) and duplicates of the run's
    checkpoint, as PNGs of the expected sizes and as TensorBoard images at its iteration."""
    seen = look.Look(look.run_config(str(tiny_run), SMALL))
    paths = seen.draw(list(look.PICTURES), writer=_Writer())
    assert [p.rsplit("/", 1)[1] for p in paths] == [
        "map.png",
        "neighbours.png",
        "attention.png",
        "duplicates.png",
    ]
    assert seen.step == 5 and len(seen.sample.paths) == 20 and seen.sample.labelled
    sizes = {name: _not_blank(tiny_run / "look" / f"{name}.png").shape[:2] for name in look.PICTURES}
    assert sizes["map"] == (700, 1400)  # two 7-inch panels at 100 dpi: PCA and t-SNE
    assert sizes["neighbours"][1] == 5 * (96 + pictures.PAD) + pictures.PAD  # a query and 4 neighbours
    assert sizes["attention"][1] == 150 * 4  # the image, then stem, s1, s2
    assert (tiny_run / "look" / "duplicates.csv").exists()
    assert _Writer.tags == [f"look/{name}" for name in look.PICTURES] and _Writer.steps == {5}


class _Writer:
    """What save_picture hands TensorBoard."""

    tags, steps = [], set()

    def add_image(self, tag, image, step, dataformats):
        assert dataformats == "HWC" and image.dtype == np.uint8 and image.shape[2] == 3
        _Writer.tags.append(tag)
        _Writer.steps.add(step)

    def flush(self):
        pass


def test_the_run_draws_its_views_and_monitor(tiny_run):
    """views.png: each image beside its two 16 px views, 8 images of 8 classes, 2 to a row;
    monitor.png: one panel per monitor series (kNN top-1, RankMe, feature std)."""
    views = _not_blank(tiny_run / "views.png")
    group = 3 * (128 + pictures.PAD) + pictures.PAD
    assert views.shape[1] == 2 * group + 3 * pictures.PAD
    monitor = _not_blank(tiny_run / "monitor.png")
    assert monitor.shape[:2] == (320, 1200)


def test_a_planted_duplicate_tops_the_csv_and_unlabelled_images_are_looked_at(tiny_run, tmp_path, one_thread):
    folder = tmp_path / "photos"
    folder.mkdir()
    rng = np.random.default_rng(0)
    for i in range(10):
        Image.fromarray(rng.integers(0, 256, (20, 20, 3), dtype=np.uint8)).save(folder / f"img{i}.png")
    shutil.copy(folder / "img3.png", folder / "copy_of_3.png")
    seen = look.Look(
        look.run_config(str(tiny_run), [*SMALL, "config.LOOK.DUPLICATE_SIMILARITY=0.99"], str(folder))
    )
    assert not seen.sample.labelled and len(seen.sample.paths) == 11
    seen.draw(["neighbours", "duplicates"])
    with open(tiny_run / "look" / "duplicates.csv") as f:
        rows = list(csv.DictReader(f))
    assert {rows[0]["path_a"].rsplit("/", 1)[1], rows[0]["path_b"].rsplit("/", 1)[1]} == {
        "img3.png",
        "copy_of_3.png",
    }
    assert float(rows[0]["similarity"]) > 0.9999 and rows[0]["label_a"] == "-1"
    with open(tiny_run / "look" / "outliers.csv") as f:
        outliers = list(csv.DictReader(f))
    assert len(outliers) == 11 and "copy_of_3.png" not in outliers[0]["path"]
    _not_blank(tiny_run / "look" / "duplicates.png")


def test_similar_pairs_are_found_once_in_chunks(monkeypatch):
    """Chunks of 3 rows find the pairs the whole matrix holds, each once, most similar first."""
    unit = similarity.unit_rows(torch.randn(10, 6, generator=torch.Generator().manual_seed(0)))
    sims = unit @ unit.t()
    expected = {(i, j) for i in range(10) for j in range(i + 1, 10) if sims[i, j] >= 0.2}
    monkeypatch.setattr(similarity, "CHUNK", 3)
    pairs, values = similarity.similar_pairs(unit, 0.2, limit=1000)
    assert {tuple(p) for p in pairs.tolist()} == expected and len(pairs) == len(expected)
    assert torch.all(values[:-1] >= values[1:])
    top, _ = similarity.similar_pairs(unit, 0.2, limit=2)
    assert top.tolist() == pairs[:2].tolist()


def test_class_token_attention_equals_the_weights_a_timm_vit_computes():
    """The weights recomputed from the last block's input equal those timm's unfused attention
    passes to its dropout (softmax(q k^T / sqrt(d)), with its q/k norms), read at the patches."""
    model = timm.create_model("test_vit", img_size=16, patch_size=4, num_classes=0).eval()
    images = torch.randn(2, 3, 16, 16)
    maps = attention.class_token_maps(model, images, attention.TokenLayout(4, True, False))
    layer = attention.attention_layer(model)
    layer.fused_attn, caught = False, {}
    handle = layer.attn_drop.register_forward_hook(lambda module, args, out: caught.setdefault("w", out))
    with torch.no_grad():
        model(images)
    handle.remove()
    prefix = caught["w"].shape[-1] - 16
    torch.testing.assert_close(maps, caught["w"][:, :, 0, prefix:].reshape(maps.shape))


def test_a_vit_draws_its_heads(tiny_run, one_thread):
    """The attention picture of a ViT (the built-in one, random weights): a column per head."""
    vit = [
        "config.MODEL.TRUNK.NAME=vit",
        "config.MODEL.TRUNK.VIT={NAME: custom, DEPTH: 1, WIDTH: 12, HEADS: 3, PATCH_SIZE: 8, IMAGE_SIZE: 32}",
        "config.MODEL.WEIGHTS_INIT.PARAMS_FILE=''",
        "config.LOOK.FEATURE=cls",
        "config.LOOK.MAX_IMAGES=10",
        "config.LOOK.ATTENTION_IMAGES=2",
        f"config.LOOK.OUTPUT_DIR={tiny_run / 'vit'}",
    ]
    look.Look(look.run_config(str(tiny_run), vit)).draw(["attention"])
    assert _not_blank(tiny_run / "vit" / "attention.png").shape[1] == 150 * 4  # the image, 3 heads


def test_monitor_png_draws_every_numeric_series_and_baselines():
    records = [
        {"iteration": 10 * e, "epoch": e, "knn_top1": 50.0 + e, "probe_top1": 40.0 + 2 * e, "rankme": 3.0,
         "feature_std": 0.05, "monitor_seconds": 0.1, "collapse_suspect": 0, "knn_top1_baseline": 45.0}
        for e in range(3)
    ]  # fmt: skip
    panels = pictures.monitor_panels(records)
    assert list(panels) == ["top-1 (%)", "RankMe", "feature std"]
    assert set(panels["top-1 (%)"]) == {"knn_top1", "probe_top1", "knn_top1_baseline"}
    assert panels["top-1 (%)"]["probe_top1"] == [(1, 40.0), (2, 42.0), (3, 44.0)]
    assert pictures.curves_figure(records).size == (1200, 320)


def _tool():
    spec = importlib.util.spec_from_file_location("look_tool", REPO / "tools" / "look.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_bad_input_is_one_line(tiny_run, tmp_path, capsys):
    tool = _tool()
    assert tool.main([str(tmp_path)]) == 2
    line = f"input error: {tmp_path} holds no config.yaml: give the folder of a run (its CHECKPOINT.DIR)"
    assert capsys.readouterr().err.strip() == line
    assert tool.main([str(tiny_run), "maps"]) == 2
    assert (
        capsys.readouterr().err.strip()
        == "input error: no picture 'maps'; valid: map, neighbours, attention, duplicates"
    )
    assert tool.main([str(tiny_run), "config.LOOK.FEATURE=s9"]) == 2
    assert (
        capsys.readouterr()
        .err.strip()
        .startswith("config error: LOOK.FEATURE 's9' is not a feature of MODEL.TRUNK")
    )
    assert tool.main([str(tiny_run), "config.LOOK.MAX_IMAGES=1"]) == 2
    assert "LOOK.MAX_IMAGES" in capsys.readouterr().err


def test_any_decoded_image_is_drawn_as_rgb():
    """16-bit and float images are scaled from their lowest to their highest value; one or two
    bands are grey, more than three keep the first three."""
    grey16 = np.array([[0, 1000], [3000, 4000]], dtype=np.uint16)
    assert pictures.as_rgb(grey16)[:, :, 0].tolist() == [[0, 64], [191, 255]]
    bands = np.random.default_rng(0).random((4, 4, 5)).astype(np.float32)
    rgb = pictures.as_rgb(bands)
    assert rgb.dtype == np.uint8 and rgb.shape == (4, 4, 3) and rgb.max() == 255 and rgb.min() == 0
    two = pictures.as_rgb(np.stack([grey16, grey16[::-1]], axis=2))
    assert np.array_equal(two[:, :, 0], two[:, :, 2]) and np.array_equal(
        two[:, :, 0], pictures.as_rgb(grey16)[:, :, 0]
    )
