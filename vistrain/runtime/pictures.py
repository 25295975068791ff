"""Pictures a run writes where people would rather look than read: the augmented views pretraining
trains on, the monitor's curves, a confusion matrix, sheets of images. Each goes to the run folder as
a PNG and to TensorBoard as an image (:func:`save_picture`).

Sheets of images and the confusion matrix are drawn with Pillow (a dependency); pictures that need
axes, legends and colour maps (the monitor's curves, the embedding maps and attention maps of
``tools/look.py``) with matplotlib, an extra (``pip install "vistrain[plots]"``) imported only when
such a picture is drawn, on its Agg renderer (no display, no global backend switched).
"""

import os
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch
from PIL import Image, ImageDraw, ImageFont

from vistrain.config.errors import InputError

PAD = 4  # pixels between tiles
BACKGROUND = (255, 255, 255)
TEXT = (0, 0, 0)
FONT_SIZE = 13  # captions and titles of the Pillow sheets
PLOTS_MISSING = 'this picture needs matplotlib: pip install "vistrain[plots]"'


def to_pixels(image: torch.Tensor, mean: Sequence[float], std: Sequence[float]) -> np.ndarray:
    """A normalised view (C, h, w) float32 back to uint8 (h, w, C), undoing ``Normalize(mean, std)``
    (C values each, or one)."""
    mean_t = torch.tensor(list(mean), dtype=torch.float32)[:, None, None]
    std_t = torch.tensor(list(std), dtype=torch.float32)[:, None, None]
    pixels = (image.float().cpu() * std_t + mean_t).clamp(0, 1) * 255
    return pixels.round().to(torch.uint8).permute(1, 2, 0).numpy()


def view_pixels(dataset, index: int) -> np.ndarray:
    """Sample ``index``'s first view (epoch 0) as uint8 (h, w, C): an SSLDataset (or a subset of
    one) un-normalised with its transform's own MEAN and STD (those computed from the images
    with DATA.NORMALIZE_FROM_IMAGES)."""
    transform = getattr(dataset, "dataset", dataset).transform
    return to_pixels(dataset.views((index, 0))[0], transform.mean, transform.std)


def as_rgb(pixels: np.ndarray) -> np.ndarray:
    """An image or view for display as uint8 (H, W, 3): other dtypes (16-bit, floats) scaled from
    their lowest to their highest value; one or two bands: the first as grey; more: the first three."""
    if pixels.dtype != np.uint8:
        values = pixels.astype(np.float64)
        low, high = np.nanmin(values), np.nanmax(values)
        pixels = np.round(np.nan_to_num((values - low) / max(high - low, 1e-12)) * 255).astype(np.uint8)
    if pixels.ndim == 2:
        pixels = pixels[:, :, None]
    if pixels.shape[2] < 3:
        pixels = np.repeat(pixels[:, :, :1], 3, axis=2)
    return np.ascontiguousarray(pixels[:, :, :3])


def font(size: int = FONT_SIZE):
    """Pillow's scalable default font at ``size`` pixels (its small bitmap font on Pillow < 10.1)."""
    try:
        return ImageFont.load_default(size=size)
    except TypeError:
        return ImageFont.load_default()


def tile(
    rows: List[List[np.ndarray]],
    side: int,
    captions: Optional[List[List[str]]] = None,
    title: str = "",
    resample=Image.NEAREST,
) -> Image.Image:
    """A sheet of ``rows`` of images (each uint8 (h, w, 3) or (h, w)), every tile resized to ``side``
    x ``side``, with an optional caption line under each tile and a title line above."""
    text = font()
    line = FONT_SIZE + 4
    caption_h = line if captions else 0
    title_h = line + PAD if title else 0
    columns = max(len(row) for row in rows)
    width = columns * (side + PAD) + PAD
    height = title_h + len(rows) * (side + caption_h + PAD) + PAD
    sheet = Image.new("RGB", (width, height), BACKGROUND)
    draw = ImageDraw.Draw(sheet)
    if title:
        draw.text((PAD, PAD), title, fill=TEXT, font=text)
    for r, row in enumerate(rows):
        y = title_h + PAD + r * (side + caption_h + PAD)
        for c, pixels in enumerate(row):
            x = PAD + c * (side + PAD)
            sheet.paste(Image.fromarray(as_rgb(pixels)).resize((side, side), resample), (x, y))
            if captions and captions[r][c]:
                draw.text((x, y + side + 1), _fit(draw, captions[r][c], side, text), fill=TEXT, font=text)
    return sheet


def _fit(draw, caption: str, width: int, text_font) -> str:
    """``caption`` cut (with "...") to ``width`` pixels."""
    if draw.textlength(caption, font=text_font) <= width:
        return caption
    while caption and draw.textlength(caption + "...", font=text_font) > width:
        caption = caption[:-1]
    return caption + "..."


def stack(sheets: Sequence[Image.Image]) -> Image.Image:
    """Sheets one below the other, left-aligned, on a white background."""
    width = max(s.width for s in sheets)
    out = Image.new("RGB", (width, sum(s.height for s in sheets)), BACKGROUND)
    y = 0
    for sheet in sheets:
        out.paste(sheet, (0, y))
        y += sheet.height
    return out


def confusion_image(
    matrix: np.ndarray, class_names: Sequence[str], title: str, cell: int = 56
) -> Image.Image:
    """``matrix`` (C, C) counts, rows true classes, columns predicted, drawn as shaded cells (shade:
    the row's share, so every class reads alike however rare) holding the counts."""
    classes = len(class_names)
    margin = 60
    size = (margin + classes * cell + PAD, margin + classes * cell + PAD)
    image = Image.new("RGB", size, BACKGROUND)
    draw = ImageDraw.Draw(image)
    draw.text((PAD, PAD), title, fill=TEXT)
    draw.text((margin, margin - 26), "predicted", fill=TEXT)
    draw.text((PAD, margin + classes * cell // 2), "true", fill=TEXT)
    shares = matrix / np.maximum(matrix.sum(axis=1, keepdims=True), 1)
    for i in range(classes):
        draw.text((margin + i * cell + 4, margin - 14), str(class_names[i]), fill=TEXT)
        draw.text((margin - 28, margin + i * cell + cell // 2 - 6), str(class_names[i]), fill=TEXT)
        for j in range(classes):
            shade = int(255 * (1 - shares[i, j]))
            box = (
                margin + j * cell,
                margin + i * cell,
                margin + (j + 1) * cell - 1,
                margin + (i + 1) * cell - 1,
            )
            draw.rectangle(box, fill=(shade, shade, 255), outline=(200, 200, 200))
            ink = (255, 255, 255) if shares[i, j] > 0.5 else TEXT
            draw.text((box[0] + cell // 3, box[1] + cell // 3), str(int(matrix[i, j])), fill=ink)
    return image


def save_picture(
    image: Image.Image, run_dir: str, name: str, writer=None, tag: str = "", step: int = 0
) -> str:
    """Write ``image`` to ``run_dir/name`` (PNG) and, with ``writer``, as TensorBoard image ``tag``."""
    path = os.path.join(run_dir, name)
    os.makedirs(run_dir, exist_ok=True)
    image.save(path)
    if writer is not None:
        writer.add_image(tag or name.rsplit(".", 1)[0], np.asarray(image), step, dataformats="HWC")
        writer.flush()
    return path


# --------------------------------------------------------------------------------------------
# what pretraining trains on


def example_indices(labels: Sequence[int], count: int) -> List[int]:
    """Up to ``count`` sample indices, the first image of each class in turn (class order), then
    the second of each...: as many classes as possible. Unlabelled (-1) samples are one class."""
    by_class: Dict[int, List[int]] = {}
    for index, label in enumerate(labels):
        if len(by_class.setdefault(int(label), [])) < count:
            by_class[int(label)].append(index)
    rounds = [[members[k] for members in by_class.values() if k < len(members)] for k in range(count)]
    return [index for turn in rounds for index in turn][:count]


def view_sheet(dataset, count: int = 8, side: int = 128) -> Image.Image:
    """``count`` images of ``dataset`` (an SSLDataset), of different classes where it has labels
    (:func:`example_indices`), as pretraining's epoch 0 sees them: each image as decoded (captioned
    with its index, class and size), then every augmented view of it the loss compares (captioned
    with its side in pixels; un-normalised with the transform's MEAN and STD), each tile ``side``
    pixels (views magnified without smoothing); as many images side by side as fit in about
    ``WIDE`` tiles."""
    groups, mean, std = [], dataset.transform.mean, dataset.transform.std
    for index in example_indices(dataset.targets, count):
        pixels, label = dataset.image(index)
        crops = dataset.views((index, 0))
        row = [pixels] + [to_pixels(crop, mean, std) for crop in crops]
        height, width = pixels.shape[:2]
        captions = [f"#{index}" + (f" class {label}" if label >= 0 else "") + f", {width}x{height}"]
        captions += [f"view {v + 1}: {crop.shape[-1]} px" for v, crop in enumerate(crops)]
        groups.append(tile([row], side, [captions]))
    per_row = max(1, WIDE // (1 + len(crops)))
    title = "an image, then the views of it the loss compares (epoch 0)"
    return titled(arrange(groups, per_row), title)


WIDE = 8  # tiles across a sheet of views before the next image goes below


def arrange(sheets: Sequence[Image.Image], columns: int, gap: int = 3 * PAD) -> Image.Image:
    """Equal-sized ``sheets`` in a grid ``columns`` wide, ``gap`` pixels apart."""
    width, height = sheets[0].size
    rows = -(-len(sheets) // columns)
    cols = min(columns, len(sheets))
    out = Image.new("RGB", (cols * (width + gap) - gap, rows * (height + gap) - gap), BACKGROUND)
    for i, sheet in enumerate(sheets):
        out.paste(sheet, ((i % columns) * (width + gap), (i // columns) * (height + gap)))
    return out


def titled(sheet: Image.Image, title: str) -> Image.Image:
    """``sheet`` under a line of text."""
    line = FONT_SIZE + 2 * PAD
    out = Image.new("RGB", (sheet.width, sheet.height + line), BACKGROUND)
    ImageDraw.Draw(out).text((PAD, PAD), title, fill=TEXT, font=font())
    out.paste(sheet, (0, line))
    return out


# --------------------------------------------------------------------------------------------
# matplotlib


def figure(width: float, height: float, dpi: int = 100):
    """A matplotlib ``Figure`` of ``width`` x ``height`` inches on its own Agg canvas (no pyplot
    state); InputError (one line) naming the extra when matplotlib is not installed."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        raise InputError(PLOTS_MISSING) from None
    fig = Figure(figsize=(width, height), dpi=dpi, layout="constrained")
    FigureCanvasAgg(fig)
    return fig


def figure_image(fig) -> Image.Image:
    """The rendered figure as an RGB Pillow image."""
    fig.canvas.draw()
    return Image.fromarray(np.asarray(fig.canvas.buffer_rgba())[:, :, :3].copy())


BOOKKEEPING = (
    "iteration",
    "epoch",
    "monitor_seconds",
    "train_seconds",
    "collapse_suspect",
    "no_better_than_baseline",
    "knn_images",
)  # flags and counts, not curves
LABELS = {
    "knn_top1": "online kNN top-1",
    "probe_top1": "online linear probe top-1",
    "rankme": "RankMe",
    "feature_std": "feature std",
}


def monitor_panels(records: Sequence[dict]) -> Dict[str, Dict[str, List[Tuple[float, float]]]]:
    """The monitor's records (metrics.jsonl, each with "epoch", 0-based) as panels: {panel title:
    {series: [(epochs done, value)...]}}. Every numeric key but :data:`BOOKKEEPING` is a series;
    the ``*top1`` series share the panel "top-1 (%)" (named after the series when it is alone),
    every other series has its own. A key
    ``<series>_baseline`` is drawn on ``<series>``'s panel as a level (its last value)."""
    panels: Dict[str, Dict[str, List[Tuple[float, float]]]] = {}
    for record in records:
        for key, value in record.items():
            if key in BOOKKEEPING or isinstance(value, bool) or not isinstance(value, (int, float)):
                continue
            series = key[: -len("_baseline")] if key.endswith("_baseline") else key
            title = "top-1 (%)" if series.endswith("top1") else LABELS.get(series, series)
            panels.setdefault(title, {}).setdefault(key, []).append((record["epoch"] + 1, float(value)))
    alone = list(panels.get("top-1 (%)", {}))
    if len(alone) == 1:  # one top-1 series: its name says which
        panels = {
            (f"{LABELS.get(alone[0], alone[0])} (%)" if t == "top-1 (%)" else t): v for t, v in panels.items()
        }
    return panels


def curves_figure(records: Sequence[dict], title: str = "") -> Image.Image:
    """The monitor's curves (:func:`monitor_panels`) side by side: each panel with its axes, ticks,
    grid and a legend where it holds several series; baselines dashed."""
    panels = monitor_panels(records)
    fig = figure(4.0 * max(len(panels), 1), 3.2)
    if title:
        fig.suptitle(title)
    for i, (name, series) in enumerate(panels.items()):
        axes = fig.add_subplot(1, max(len(panels), 1), i + 1)
        for key, points in series.items():
            xs, ys = zip(*points)
            if key.endswith("_baseline"):
                axes.axhline(
                    ys[-1], linestyle="--", color="gray", label=LABELS.get(key, key.replace("_", " "))
                )
            else:
                axes.plot(xs, ys, marker="o", markersize=3, label=LABELS.get(key, key))
        axes.set_title(name)
        axes.set_xlabel("epoch")
        axes.grid(True, alpha=0.4)
        if len(series) > 1:
            axes.legend(fontsize="small")
    return figure_image(fig)
