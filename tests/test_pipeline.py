"""The data pipeline's fast paths keep its views: the views made on the device (VIEWS_ON_DEVICE) are
the CPU path's, JPEGs decoded by torchvision.io are PIL's pixels, a JPEG decoded at reduced size
still gives every crop at least as many source pixels as it has, and a corrupt JPEG follows
SKIP_CORRUPT."""

import math
import os

import numpy as np
import pytest
import torch
from PIL import Image

from vistrain.config.errors import DataError
from vistrain.data import CorruptImageError, build_loader, read_image, set_epoch
from vistrain.data.device_views import DeviceViewsLoader, pack, unpack
from vistrain.data.folders import draft_fits, draft_scale
from vistrain.data.pixels import read_pixels
from vistrain.data.views import crop_boxes
from vistrain.methods import get_defaults

CPU = torch.device("cpu")


def _photo(height, width, seed=0, gray=False):
    """A smooth uint8 image (H, W, 3) or (H, W): JPEG-friendly, not constant."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width]
    channels = [
        np.sin(x / (5 + 7 * rng.random()) + y / (9 + 5 * rng.random()) + rng.random()) for _ in range(3)
    ]
    pixels = np.stack(channels, -1) * 100 + 128 + rng.normal(0, 6, (height, width, 3))
    pixels = np.clip(pixels, 0, 255).astype(np.uint8)
    return pixels[..., 0] if gray else pixels


def _jpeg_folder(root, sizes=((40, 30), (24, 36), (33, 33), (30, 40), (28, 28)), png=True):
    os.makedirs(root, exist_ok=True)
    paths = []
    for i, (h, w) in enumerate(sizes):
        paths.append(os.path.join(root, f"{i}.jpg"))
        Image.fromarray(_photo(h, w, seed=i, gray=i == 1)).save(paths[-1], quality=90)
    if png:  # a grayscale PNG among them: PIL's path, a one-channel image in an RGB batch
        paths.append(os.path.join(root, "gray.png"))
        Image.fromarray(_photo(26, 26, seed=9, gray=True)).save(paths[-1])
    return paths


def _data_cfg(root, batch=3, **transforms):
    cfg = get_defaults().DATA
    cfg.NUM_DATALOADER_WORKERS = 0
    split = cfg.TRAIN
    split.DATA_SOURCES, split.DATA_PATHS, split.FOLDER_LABELS = ["disk_folder"], [str(root)], "none"
    split.BATCHSIZE_PER_REPLICA = batch
    t = split.TRANSFORMS
    t.NUM_CROPS, t.SIZE_CROPS, t.CROP_SCALES = [2, 2], [16, 8], [[0.3, 1.0], [0.05, 0.3]]
    t.SOLARIZE_PROB, t.VERTICAL_FLIP, t.ROTATE_90 = 0.3, 0.3, 0.3
    for key, value in transforms.items():
        t[key] = value
    return cfg


# ------------------------------------------------------------------------------ views on the device
@pytest.mark.parametrize(
    "workers, geometric",
    [
        (1, {}),
        (0, {"AFFINE_DEGREES": 15.0, "AFFINE_SCALE": [0.9, 1.1], "ELASTIC_PROB": 0.5, "ELASTIC_SIGMA": 2.0}),
    ],
    ids=["worker", "affine+elastic"],
)
def test_views_on_the_device_are_the_cpu_views(tmp_path, workers, geometric, one_thread):
    """The same draws give the same views whether the loader makes them or the device path does
    (here the device is the CPU, through the device path's split: collate in the worker, views in
    the rank); with a worker, the packed batch crosses processes in shared memory."""
    _jpeg_folder(str(tmp_path))
    cfg = _data_cfg(tmp_path, **geometric)
    reference = build_loader(cfg, "TRAIN", seed=3, device=CPU)
    cfg.TRAIN.VIEWS_ON_DEVICE, cfg.NUM_DATALOADER_WORKERS = True, workers
    on_device = build_loader(cfg, "TRAIN", seed=3, device=CPU)
    assert isinstance(on_device, DeviceViewsLoader) and len(on_device) == len(reference) == 2
    set_epoch(reference, 1)
    set_epoch(on_device, 1)
    pairs = list(zip(reference, on_device))  # a whole epoch: the worker is left idle, not busy
    assert len(pairs) == 2
    for cpu, device in pairs:
        assert set(device) == set(cpu)
        assert torch.equal(cpu["index"], device["index"]) and torch.equal(cpu["label"], device["label"])
        assert [c.shape for c in device["crops"]] == [c.shape for c in cpu["crops"]]
        for ours, theirs in zip(device["crops"], cpu["crops"]):
            torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-6)


def test_pack_and_unpack_keep_every_tensor():
    prepared = [
        {
            "pixels": torch.arange(24, dtype=torch.uint8).view(2, 3, 4).permute(0, 2, 1),
            "draws": [(torch.rand(2, 5), None)],
        },
        {
            "pixels": torch.ones(1, 2, 2, dtype=torch.uint8),
            "draws": [(torch.rand(3, 5), torch.rand(1, 2, 2, 2))],
            "n": 7,
        },
    ]
    packed = pack(prepared)
    assert sorted(packed["buffers"]) == ["float32", "uint8"]
    back = unpack(packed, CPU)
    assert back[1]["n"] == 7 and back[0]["draws"][0][1] is None
    for before, after in zip(prepared, back):
        assert torch.equal(before["pixels"], after["pixels"])
        for (u, noise), (u2, noise2) in zip(before["draws"], after["draws"]):
            assert torch.equal(u, u2) and (noise is None or torch.equal(noise, noise2))


# ---------------------------------------------------------------------------------------- decoding
def test_jpegs_decode_to_pils_pixels(tmp_path):
    paths = _jpeg_folder(str(tmp_path), png=False)
    for path in paths:
        for mode in ("RGB", "L"):
            ours, pil = read_pixels(path, mode), np.array(read_image(path, mode))
            assert ours.dtype == np.uint8 and np.array_equal(ours, pil), (path, mode)


RECIPES = {  # (size, scale range) per resolution
    "simclr": [(224, (0.08, 1.0))],
    "dino": [(224, (0.4, 1.0)), (96, (0.05, 0.4))],
    "tiny": [(16, (0.3, 1.0)), (8, (0.05, 0.3))],
}


def _transforms_cfg(crops):
    cfg = get_defaults().DATA.TRAIN.TRANSFORMS
    cfg.NUM_CROPS = [1] * len(crops)
    cfg.SIZE_CROPS = [size for size, _ in crops]
    cfg.CROP_SCALES = [list(scale) for _, scale in crops]
    return cfg


@pytest.mark.parametrize("recipe", sorted(RECIPES))
def test_a_reduced_decode_leaves_every_crop_its_pixels(recipe, one_thread):
    """Over image sizes and aspects, the crops of an image decoded at PIL's reduced size (ceil(side
    / s)) have at least as many source pixels per side as output pixels: at the smallest area,
    both extreme aspects and random draws; and large images are reduced."""
    fits = draft_fits(_transforms_cfg(RECIPES[recipe]))
    rng = np.random.default_rng(0)
    sides = [(int(h), int(w)) for h, w in rng.integers(8, 6000, (300, 2))] + [
        (4000, 3000),
        (9000, 300),
        (300, 9000),
    ]
    scales = [draft_scale(width, height, fits) for height, width in sides]
    reduced = torch.tensor(
        [(math.ceil(h / s), math.ceil(w / s)) for (h, w), s in zip(sides, scales) if s > 1]
    )
    assert len(reduced) > 20
    draws = 32  # per image: the smallest area, the two extreme aspects, random draws
    u_area, u_ratio = torch.tensor(rng.random((draws, 10))), torch.tensor(rng.random((draws, 10)))
    u_area[:3], u_ratio[0], u_ratio[1] = 0.0, 0.0, 1 - 1e-12
    u_area, u_ratio = u_area.repeat(len(reduced), 1), u_ratio.repeat(len(reduced), 1)
    u_place = torch.tensor(rng.random((len(u_area), 2)))
    heights, widths = reduced.repeat_interleave(draws, 0).unbind(1)
    for size, crop_scale in RECIPES[recipe]:
        boxes = crop_boxes(u_area, u_ratio, u_place, heights, widths, crop_scale)
        assert (boxes[:, 2:] >= size).all(), boxes[:, 2:].min()
    simclr = draft_fits(_transforms_cfg(RECIPES["simclr"]))
    assert simclr(1500, 2000) and not simclr(1000, 750) and draft_scale(4000, 3000, simclr) == 2


def test_a_reduced_decode_is_what_pil_draft_gives(tmp_path):
    path = str(tmp_path / "big.jpg")
    Image.fromarray(_photo(200, 264)).save(path, quality=90)
    cfg = _transforms_cfg(RECIPES["tiny"])
    assert draft_scale(264, 200, draft_fits(cfg)) == 4  # 1/8: 25 x 33 px, too few for the 8 px crops at 5%
    pixels = read_pixels(path, "RGB", draft_fits(cfg))
    assert pixels.shape == (50, 66, 3)
    cfg.AFFINE_DEGREES = 5.0  # a rotation before the crop: decoded at full size
    assert draft_fits(cfg) is None and read_pixels(path, "RGB", draft_fits(cfg)).shape == (200, 264, 3)


def _corrupt_jpegs(root):
    """A folder of JPEGs with a truncated small one (torchvision's path), a truncated large one
    (decoded at reduced size: PIL's path) and one that is not an image."""
    paths = _jpeg_folder(root, png=False)
    Image.fromarray(_photo(200, 264, seed=5)).save(os.path.join(root, "5.jpg"), quality=90)
    bad = [paths[2], os.path.join(root, "5.jpg"), os.path.join(root, "6.jpg")]
    for path in bad[:2]:
        with open(path, "rb") as handle:
            data = handle.read()
        _write(path, data[: len(data) // 2])
    _write(bad[2], b"\xff\xd8\xff not a JPEG after all")
    return bad


def _write(path, data):
    with open(path, "wb") as handle:
        handle.write(data)


def test_a_corrupt_jpeg_follows_skip_corrupt(tmp_path):
    bad = _corrupt_jpegs(str(tmp_path))
    cfg = _data_cfg(tmp_path, batch=7)
    cfg.TRAIN.DROP_LAST = False
    assert draft_scale(264, 200, draft_fits(cfg.TRAIN.TRANSFORMS)) > 1
    for path in bad:
        with pytest.raises(CorruptImageError, match=f"cannot read image {path}: "):
            read_pixels(path, "RGB", draft_fits(cfg.TRAIN.TRANSFORMS))
    with pytest.raises(CorruptImageError, match="cannot read image .*SKIP_CORRUPT=True to skip"):
        list(build_loader(cfg, "TRAIN", seed=0, device=CPU))
    cfg.TRAIN.SKIP_CORRUPT, cfg.TRAIN.VIEWS_ON_DEVICE = True, True
    loader = build_loader(cfg, "TRAIN", seed=0, device=CPU)
    set_epoch(loader, 0)
    batches = list(loader)
    assert sum(b["num_skipped"] for b in batches) >= 3 and loader.dataset.num_skipped >= 3
    paths = loader.dataset.sources[0].paths
    assert not {paths[i] for b in batches for i in b["index"].tolist()} & set(bad)
    with pytest.raises(DataError, match="consecutive unreadable images"):
        for path in paths:
            _write(path, b"broken")
        list(build_loader(cfg, "TRAIN", seed=0, device=CPU))


# ------------------------------------------------------------------------------- decoded on the device
@pytest.mark.parametrize(
    "workers, more",
    [(1, {}), (0, {"ELASTIC_PROB": 0.5, "ELASTIC_SIGMA": 2.0, "AFFINE_DEGREES": 15.0})],
    ids=["worker", "elastic+range"],
)
def test_jpegs_decoded_on_the_device_give_the_cpu_views(tmp_path, workers, more, one_thread):
    """DECODE_ON_DEVICE (the device here the CPU, through the same path: headers and draws in the
    worker, one decode_jpeg call on a list in the rank) gives the CPU path's views of the JPEGs, a
    grayscale one and a PNG among them; with a PIXEL_RANGE and the elastic step's noise drawn from
    the header's size too."""
    _jpeg_folder(str(tmp_path))
    cfg = _data_cfg(tmp_path, **more)
    if more:
        cfg.TRAIN.PIXEL_RANGE = [10.0, 240.0]
    reference = build_loader(cfg, "TRAIN", seed=3, device=CPU)
    cfg.TRAIN.DECODE_ON_DEVICE, cfg.NUM_DATALOADER_WORKERS = True, workers
    on_device = build_loader(cfg, "TRAIN", seed=3, device=CPU)
    assert isinstance(on_device, DeviceViewsLoader)
    kept = [on_device.dataset[(i, 1)]["prepared"] for i in range(len(on_device.dataset))]
    assert ["jpeg" in p for p in kept] == [True] * 5 + [False]  # the PNG decoded in the worker
    for ours, theirs in zip(on_device.dataset.views((0, 1)), reference.dataset.views((0, 1))):
        assert torch.equal(ours, theirs)  # one sample's views (pictures of a run): on the CPU
    for loader in (reference, on_device):
        set_epoch(loader, 1)
    _assert_same_batches(list(reference), list(on_device), batches=2)


def _assert_same_batches(cpu_batches, device_batches, batches):
    assert len(cpu_batches) == len(device_batches) == batches
    for cpu, device in zip(cpu_batches, device_batches):
        assert set(device) == set(cpu) and device["num_skipped"] == cpu["num_skipped"]
        assert torch.equal(cpu["index"], device["index"]) and torch.equal(cpu["label"], device["label"])
        for ours, theirs in zip(device["crops"], cpu["crops"], strict=True):
            torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-6)


def test_a_corrupt_jpeg_decoded_on_the_device_follows_skip_corrupt(tmp_path, one_thread):
    """A truncated JPEG whose header reads fails to decode in the rank; decoded again there as the
    CPU path decodes it, it stops the loader with the CPU path's line, or with SKIP_CORRUPT is
    replaced as the CPU path replaces it: the same views, indices, labels and skip counts (beside
    JPEGs whose headers do not read, and a PNG, that fail or decode in the worker)."""
    _corrupt_jpegs(str(tmp_path))  # 2.jpg and 6.jpg fail in the worker (their headers), 5.jpg too (PIL)
    truncated = str(tmp_path / "3.jpg")
    Image.fromarray(_photo(60, 60, seed=3)).save(truncated, quality=90)
    with open(truncated, "rb") as handle:
        _write(truncated, handle.read()[:1500])  # of about 1,950 bytes: its header reads
    Image.fromarray(_photo(26, 26, seed=9)).save(str(tmp_path / "7.png"))
    cfg = _data_cfg(tmp_path, batch=4)
    cfg.TRAIN.DROP_LAST, cfg.TRAIN.DECODE_ON_DEVICE = False, True
    cfg.TRAIN.DATA_SOURCES, cfg.TRAIN.DATA_PATHS = ["disk_filelist"], [str(tmp_path / "list.txt")]
    (tmp_path / "list.txt").write_text("0.jpg 0\n3.jpg 0\n7.png 0\n")
    loader = build_loader(cfg, "TRAIN", seed=0, device=CPU)
    assert "jpeg" in loader.dataset[(1, 0)]["prepared"]
    set_epoch(loader, 0)
    with pytest.raises(
        CorruptImageError, match=f"cannot read image {truncated}: .*SKIP_CORRUPT=True to skip"
    ):
        list(loader)
    cfg.TRAIN.SKIP_CORRUPT = True
    cfg.TRAIN.DATA_SOURCES, cfg.TRAIN.DATA_PATHS = ["disk_folder"], [str(tmp_path)]
    loaders = []
    for decode in (False, True):
        cfg.TRAIN.DECODE_ON_DEVICE = decode
        loaders.append(build_loader(cfg, "TRAIN", seed=0, device=CPU))
        set_epoch(loaders[-1], 0)
    assert len(loaders[1].dataset) == 8
    _assert_same_batches(list(loaders[0]), list(loaders[1]), batches=2)
