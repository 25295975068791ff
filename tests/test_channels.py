"""Images that are not 8-bit RGB (vistrain/data/pixels.py): 4-band TIFF and .npy images and 16-bit
PNGs read and scaled, N-channel views (colour ops on RGB only) into N-channel trunks, grey views
equal to the grey channel of the RGB path, normalisation from the data, and 3-channel weights
adapted to 1 and 4 input channels as timm adapts them."""

import logging
import runpy
import struct
import sys
import zlib
from pathlib import Path

import numpy as np
import pytest
import tifffile
import torch
from PIL import Image
from timm.models._manipulate import adapt_input_conv as timm_adapt_input_conv

from vistrain.checkpoint import load_pretrained
from vistrain.checkpoint.input_conv import adapt_input_conv
from vistrain.config import ConfigError, DataError
from vistrain.data.datasets import build_dataset
from vistrain.data.loader import image_statistics
from vistrain.data.pixels import fit_channels, read_pixels
from vistrain.jobs import check_values, normalized_config
from vistrain.methods import build_model, load_config

TINY = "test/simclr_tiny"
STILL = [  # views that only crop (the whole image) and resize: pixels in, pixels out
    "config.DATA.TRAIN.TRANSFORMS.CROP_SCALES=[[1.0,1.0]]",
    "config.DATA.TRAIN.TRANSFORMS.HORIZONTAL_FLIP=0.0",
    "config.DATA.TRAIN.TRANSFORMS.COLOR_DISTORTION=0.0",
    "config.DATA.TRAIN.TRANSFORMS.BLUR_PROB=0.0",
]


def _folder_cfg(folder, *overrides, channels=4):
    return load_config(
        [
            f"config={TINY}",
            "config.DATA.TRAIN.DATA_SOURCES=[disk_folder]",
            f"config.DATA.TRAIN.DATA_PATHS=[{folder}]",
            f"config.DATA.CHANNELS={channels}",
            f"config.MODEL.TRUNK.IN_CHANNELS={channels}",
            *overrides,
        ]
    )


def _views(cfg, count=None, epoch=0):
    data = build_dataset(cfg.DATA.TRAIN, channels=cfg.DATA.CHANNELS)
    samples = [data[(i, epoch)] for i in range(count or len(data))]
    return data.collate(samples)["crops"]


def _png16(path, pixels: np.ndarray) -> None:
    """A 16-bit RGB PNG (PIL writes none): signature, IHDR, one IDAT of unfiltered rows, IEND."""

    def chunk(kind, data):
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    height, width, _ = pixels.shape
    rows = b"".join(b"\x00" + row.astype(">u2").tobytes() for row in pixels)
    header = struct.pack(">IIBBBBB", width, height, 16, 2, 0, 0, 0)
    with open(path, "wb") as handle:
        handle.write(
            b"\x89PNG\r\n\x1a\n"
            + chunk(b"IHDR", header)
            + chunk(b"IDAT", zlib.compress(rows))
            + chunk(b"IEND", b"")
        )


@pytest.fixture
def bands(tmp_path):
    """Four 4-band 16-bit images of 16 x 16: TIFF (channels last and band-interleaved) and .npy."""
    rng = np.random.default_rng(0)
    images = [rng.integers(0, 65536, (16, 16, 4), dtype=np.uint16) for _ in range(4)]
    folder = tmp_path / "bands"
    folder.mkdir()
    tifffile.imwrite(folder / "a.tif", images[0], photometric="minisblack", planarconfig="contig")
    tifffile.imwrite(
        folder / "b.tiff", np.moveaxis(images[1], -1, 0), photometric="minisblack", planarconfig="separate"
    )
    np.save(folder / "c.npy", images[2])
    np.save(folder / "d.npy", images[3].astype(">u2"))  # big-endian: read in native order
    return folder, images


def test_four_band_tiff_and_npy_images_are_read_and_scaled(bands):
    folder, images = bands
    for name, image in zip(("a.tif", "b.tiff", "c.npy", "d.npy"), images):
        np.testing.assert_array_equal(read_pixels(str(folder / name)), image)
    five = np.arange(8 * 9 * 5, dtype=np.uint8).reshape(8, 9, 5)
    tifffile.imwrite(folder / "e.tif", five, photometric="minisblack", planarconfig="contig")
    np.testing.assert_array_equal(read_pixels(str(folder / "e.tif")), five)
    (folder / "e.tif").unlink()
    # whole-image views of 16 px: the pixels / 65535, normalised per band
    mean, std = [0.1, 0.2, 0.3, 0.4], [0.5, 0.6, 0.7, 0.8]
    cfg = _folder_cfg(
        folder, *STILL, f"config.DATA.TRAIN.TRANSFORMS.MEAN={mean}", f"config.DATA.TRAIN.TRANSFORMS.STD={std}"
    )
    crops = _views(cfg)
    expected = torch.stack([torch.from_numpy(i.astype(np.float64) / 65535).permute(2, 0, 1) for i in images])
    expected = (expected - torch.tensor(mean).view(1, 4, 1, 1)) / torch.tensor(std).view(1, 4, 1, 1)
    torch.testing.assert_close(crops[0].double(), expected, rtol=0, atol=1e-5)
    # a configured range: [0, 4095] -> most values clip to 1
    clipped = _views(
        _folder_cfg(
            folder,
            *STILL,
            "config.DATA.TRAIN.PIXEL_RANGE=[0,4095]",
            "config.DATA.TRAIN.TRANSFORMS.MEAN=[0.0]",
            "config.DATA.TRAIN.TRANSFORMS.STD=[1.0]",
        )
    )
    want = torch.from_numpy(np.clip(images[0] / 4095, 0, 1)).permute(2, 0, 1).float()
    torch.testing.assert_close(clipped[0][0], want, rtol=0, atol=1e-6)


def test_sixteen_bit_pngs_keep_their_bits(tmp_path):
    rng = np.random.default_rng(1)
    grey = rng.integers(0, 65536, (12, 10), dtype=np.uint16)
    Image.fromarray(grey).save(tmp_path / "grey.png")
    colour = rng.integers(0, 65536, (12, 10, 3), dtype=np.uint16)
    _png16(tmp_path / "colour.png", colour)
    np.testing.assert_array_equal(read_pixels(str(tmp_path / "grey.png")), grey)
    np.testing.assert_array_equal(read_pixels(str(tmp_path / "colour.png")), colour)
    # the eval transform: whole 12 x 10 -> resized (tensor path) -> views in [0, 1] / 65535 units
    cfg = _folder_cfg(
        tmp_path, "config.DATA.TRAIN.TRANSFORMS.NAME=eval", "config.DATA.TRAIN.TRANSFORMS.RESIZE=10",
        "config.DATA.TRAIN.TRANSFORMS.CENTER_CROP=10", "config.DATA.TRAIN.TRANSFORMS.MEAN=[0.0]",
        "config.DATA.TRAIN.TRANSFORMS.STD=[1.0]", channels=3,
    )  # fmt: skip
    views = _views(cfg)[0]
    assert views.shape == (2, 3, 10, 10)
    torch.testing.assert_close(
        views[0], torch.from_numpy(colour[1:11] / 65535).permute(2, 0, 1).float(), rtol=0, atol=1e-6
    )
    torch.testing.assert_close(
        views[1], torch.from_numpy(grey[1:11] / 65535).float().expand(3, -1, -1), rtol=0, atol=1e-6
    )


def test_channels_fit_or_fail_in_one_line():
    rgb = np.random.default_rng(2).integers(0, 256, (5, 7, 3), dtype=np.uint8)
    np.testing.assert_array_equal(fit_channels(rgb, 1), np.array(Image.fromarray(rgb).convert("L")))
    grey = np.array(Image.fromarray(rgb).convert("L"))
    np.testing.assert_array_equal(fit_channels(np.stack([grey] * 3, -1), 1), grey)  # grey saved as RGB: exact
    assert fit_channels(grey, 3) is grey  # views made on the one channel, repeated last
    with pytest.raises(
        DataError,
        match=r"an image of 4 channels, but the views have DATA.CHANNELS=3: set MODEL.TRUNK.IN_CHANNELS=4 \(DATA",
    ):
        fit_channels(np.zeros((4, 4, 4), np.uint16), 3)


def test_colour_ops_are_rgb_only_and_bands_see_what_grey_sees(tmp_path, caplog):
    """A 4-band image of four equal bands: every band of its views is the view of the grey image
    (crops, flips, brightness, contrast, blur on any channel count); solarisation is skipped."""
    grey = np.random.default_rng(3).integers(0, 256, (20, 20), dtype=np.uint8)
    (tmp_path / "g").mkdir()
    (tmp_path / "b").mkdir()
    Image.fromarray(grey).save(tmp_path / "g" / "x.png")
    np.save(tmp_path / "b" / "x.npy", np.stack([grey] * 4, -1))
    busy = ["config.DATA.TRAIN.TRANSFORMS.COLOR_DISTORTION=1.0", "config.DATA.TRAIN.TRANSFORMS.BLUR_PROB=1.0",
            "config.DATA.TRAIN.TRANSFORMS.NUM_CROPS=[4]", "config.DATA.TRAIN.TRANSFORMS.MEAN=[0.5]",
            "config.DATA.TRAIN.TRANSFORMS.STD=[0.25]"]  # fmt: skip
    solarise = "config.DATA.TRAIN.TRANSFORMS.SOLARIZE_PROB=1.0"
    with caplog.at_level(logging.INFO, logger="vistrain.data.transforms"):
        bands = _views(_folder_cfg(tmp_path / "b", *busy, solarise))
    assert "saturation, hue, random grayscale and solarisation are skipped" in caplog.text
    unsolarised = _views(_folder_cfg(tmp_path / "g", *busy, channels=1))
    solarised = _views(_folder_cfg(tmp_path / "g", *busy, solarise, channels=1))
    for view, plain in zip(bands, unsolarised):
        assert view.shape == (1, 4, 16, 16)
        torch.testing.assert_close(view, plain.expand(-1, 4, -1, -1), rtol=0, atol=1e-6)
    assert not all(torch.equal(a, b) for a, b in zip(unsolarised, solarised))  # grey views are solarised


def test_grey_views_are_the_grey_channel_of_rgb_views(tmp_path):
    """DATA.CHANNELS=1 on a one-channel source gives exactly the first channel of its 3-channel
    views (the shipped grey recipes' views, unchanged: both are made on the one channel); grey
    PNGs in a folder (read as RGB, as ever) made grey again give the same views to float rounding."""
    rng = np.random.default_rng(4)
    for name in ("arrays", "pngs"):
        (tmp_path / name).mkdir()
    for i in range(3):
        grey = rng.integers(0, 256, (18, 22), dtype=np.uint8)
        np.save(tmp_path / "arrays" / f"{i}.npy", grey)
        Image.fromarray(grey).save(tmp_path / "pngs" / f"{i}.png")
    mean = [
        "config.DATA.TRAIN.TRANSFORMS.MEAN=[0.5,0.5,0.5]",
        "config.DATA.TRAIN.TRANSFORMS.STD=[0.25,0.25,0.25]",
    ]
    for name in ("arrays", "pngs"):
        rgb = _views(_folder_cfg(tmp_path / name, *mean, channels=3), epoch=2)
        one = _views(_folder_cfg(tmp_path / name, *mean, channels=1), epoch=2)
        for a, b in zip(rgb, one):
            assert b.shape[1] == 1
            torch.testing.assert_close(a[:, :1], b, rtol=0, atol=0 if name == "arrays" else 1e-5)


def test_normalisation_from_the_images_and_its_errors(bands):
    folder, images = bands
    cfg = _folder_cfg(folder, "config.DATA.NORMALIZE_FROM_IMAGES=2")
    mean, std, count = image_statistics(cfg.DATA)
    used = np.stack([images[0], images[2]]).reshape(-1, 4) / 65535  # images 0 and 2 of 4 (evenly spaced)
    np.testing.assert_allclose(mean, used.mean(0), rtol=1e-6)
    np.testing.assert_allclose(std, used.std(0), rtol=1e-6)
    # the command line computes them once and hands the ranks (and config.yaml) the values
    resolved, line = normalized_config(cfg)
    assert resolved.DATA.NORMALIZE_FROM_IMAGES == 0 and count == 2 and "of 2 images of DATA.TRAIN" in line
    assert resolved.DATA.TRAIN.TRANSFORMS.MEAN == resolved.DATA.TEST.TRANSFORMS.MEAN == mean
    with pytest.raises(
        ConfigError, match=r"TRANSFORMS.MEAN needs DATA.CHANNELS=4 values \(or one for every channel\), got 3"
    ):
        build_dataset(_folder_cfg(folder).DATA.TRAIN, channels=4)  # ImageNet's 3 values
    with pytest.raises(ConfigError, match=r"PIXEL_RANGE must be \[\] .* or \[low, high\]"):
        build_dataset(
            _folder_cfg(
                folder,
                "config.DATA.TRAIN.PIXEL_RANGE=[5,1]",
                "config.DATA.TRAIN.TRANSFORMS.MEAN=[0.5]",
            ).DATA.TRAIN,
            channels=4,
        )


def test_the_views_follow_the_trunk_unless_told_otherwise():
    """DATA.CHANNELS takes MODEL.TRUNK.IN_CHANNELS unless set; set to another value, one line.
    The ELPV recipe trains (and evaluates) a 1-channel trunk with one override."""
    for recipe in ("pretrain/simclr_regnet_elpv", "benchmark/linear_eval_elpv"):
        cfg = load_config([f"config={recipe}", "config.MODEL.TRUNK.IN_CHANNELS=1"])
        assert cfg.DATA.CHANNELS == 1
    check_values(cfg, files=False)  # the linear evaluation's
    cfg = load_config([f"config={TINY}", "config.MODEL.TRUNK.IN_CHANNELS=1", "config.DATA.CHANNELS=3"])
    with pytest.raises(
        ConfigError, match="MODEL.TRUNK.IN_CHANNELS=1, but the views have DATA.CHANNELS=3: set both"
    ) as info:
        check_values(cfg, files=False)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize(
    "trunk", [[], ["config.MODEL.TRUNK.NAME=timm", "config.MODEL.TRUNK.TIMM.NAME=test_vit",
                   "config.MODEL.TRUNK.TIMM.KWARGS={img_size: 16, patch_size: 4}", "config.MODEL.HEAD.DIMS=[64,32,16]"]],
    ids=["regnet", "timm"],
)  # fmt: skip
def test_band_views_train_a_trunk_of_four_channels(bands, trunk, one_thread):
    folder, _ = bands
    cfg = _folder_cfg(
        folder, "config.DATA.TRAIN.TRANSFORMS.MEAN=[0.5]", "config.DATA.TRAIN.TRANSFORMS.STD=[0.25]", *trunk
    )
    check_values(cfg, files=False)
    model = build_model(cfg.MODEL)
    crops = _views(cfg)
    loss = sum(out.square().mean() for out in model(crops))
    loss.backward()
    first = next(m for m in model.modules() if isinstance(m, torch.nn.Conv2d))
    assert first.in_channels == 4 and first.weight.grad.abs().sum() > 0


def test_rgb_kernels_adapt_as_timm_adapts_them(tmp_path, caplog, one_thread):
    kernels = torch.randn(8, 3, 3, 3, generator=torch.Generator().manual_seed(5))
    for channels in (1, 4, 7):
        expected = timm_adapt_input_conv(channels, kernels.clone())
        torch.testing.assert_close(adapt_input_conv(kernels, channels), expected, rtol=0, atol=0)
    # a 3-channel trunk's weights into a 1-channel trunk: the grey image gives the RGB trunk's features
    rgb = build_model(load_config([f"config={TINY}"]).MODEL).eval()
    torch.save(rgb.state_dict(), tmp_path / "rgb.pt")
    cfg = load_config(
        [
            f"config={TINY}",
            "config.MODEL.TRUNK.IN_CHANNELS=1",
            f"config.MODEL.WEIGHTS_INIT.PARAMS_FILE={tmp_path / 'rgb.pt'}",
        ]
    )
    grey = build_model(cfg.MODEL).eval()
    with caplog.at_level(logging.INFO, logger="vistrain"):
        load_pretrained(grey, cfg.MODEL.WEIGHTS_INIT)
    assert "RGB kernels adapted to 1 input channels (summed over R, G, B, as timm does)" in caplog.text
    x = torch.rand(2, 1, 16, 16)
    with torch.no_grad():
        torch.testing.assert_close(
            grey.trunk(x)["avgpool"], rgb.trunk(x.expand(-1, 3, -1, -1))["avgpool"], rtol=1e-4, atol=1e-5
        )


def test_without_tifffile_the_line_names_the_extra(bands, monkeypatch):
    folder, _ = bands
    monkeypatch.setitem(sys.modules, "tifffile", None)  # import tifffile now fails
    with pytest.raises(
        ConfigError,
        match=r'a.tif \(more bands or bits than PIL reads\) needs tifffile: pip install "vistrain\[tiff\]"$',
    ):
        read_pixels(str(folder / "a.tif"))


def test_band_images_in_tar_shards(bands, tmp_path, capsys):
    """Shards made from a folder of band images hold the files' bytes: read back as the folder reads them."""
    folder, images = bands
    make_shards = runpy.run_path(str(Path(__file__).parents[1] / "tools" / "make_shards.py"))["main"]
    assert make_shards([str(folder), str(tmp_path / "shards")]) == 0
    pattern = '"' + str(tmp_path / "shards" / "bands-{000000..000000}.tar") + '"'
    cfg = _folder_cfg(
        pattern,
        "config.DATA.TRAIN.DATA_SOURCES=[webdataset]",
        "config.DATA.TRAIN.TRANSFORMS.MEAN=[0.5]",
        "config.DATA.TRAIN.TRANSFORMS.STD=[0.25]",
    )
    data = build_dataset(cfg.DATA.TRAIN, channels=4)
    got = sorted((data.sources[0].load(i)[0] for i in range(4)), key=lambda a: int(a[0, 0, 0]))
    for array, image in zip(got, sorted(images, key=lambda a: int(a[0, 0, 0]))):
        np.testing.assert_array_equal(array, image)
    assert data.views(0)[0].shape == (4, 16, 16)
