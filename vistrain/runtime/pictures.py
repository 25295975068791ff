"""Pictures a run writes where people would rather look than read (Pillow only): the augmented views
pretraining trains on, a confusion matrix, a sheet of nearest neighbours. Each goes to the run
folder as a PNG and to TensorBoard as an image (rank 0's writer).
"""

import os
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch
from PIL import Image, ImageDraw

PAD = 4  # pixels between tiles
BACKGROUND = (255, 255, 255)
TEXT = (0, 0, 0)


def to_pixels(image: torch.Tensor, mean: Sequence[float], std: Sequence[float]) -> np.ndarray:
    """A normalised view (C, h, w) float32 back to uint8 (h, w, 3), undoing ``Normalize(mean, std)``
    (C values each, one for all, or for a grey view three averaged; other lengths: the view's own
    range). A view of other than 3 channels is shown grey, from its first channel."""
    channels, image = image.shape[0], image.float().cpu()
    mean_t, std_t = _per_channel(mean, channels), _per_channel(std, channels)
    if mean_t is None or std_t is None:
        low, high = image.amin(), image.amax()
        mean_t, std_t = low, (high - low).clamp(min=1e-6)
    pixels = ((image * std_t + mean_t).clamp(0, 1) * 255).round().to(torch.uint8)
    if channels != 3:
        pixels = pixels[:1].expand(3, -1, -1)
    return pixels.permute(1, 2, 0).numpy()


def _per_channel(values: Sequence[float], channels: int) -> Optional[torch.Tensor]:
    """(channels, 1, 1) of ``values`` fitted to ``channels`` as the views' normalisation fits them."""
    values = [float(v) for v in values]
    if len(values) == 3 and channels == 1:
        values = [sum(values) / 3]
    if len(values) == 1:
        values = values * channels
    return torch.tensor(values)[:, None, None] if len(values) == channels else None


def tile(rows: List[List[np.ndarray]], side: int, captions: Optional[List[List[str]]] = None) -> Image.Image:
    """A sheet of ``rows`` of images (each uint8 (h, w, 3)), every tile resized to ``side`` x ``side``,
    with an optional caption line under each tile."""
    caption_h = 12 if captions else 0
    columns = max(len(row) for row in rows)
    width = columns * (side + PAD) + PAD
    height = len(rows) * (side + caption_h + PAD) + PAD
    sheet = Image.new("RGB", (width, height), BACKGROUND)
    draw = ImageDraw.Draw(sheet)
    for r, row in enumerate(rows):
        y = PAD + r * (side + caption_h + PAD)
        for c, pixels in enumerate(row):
            x = PAD + c * (side + PAD)
            sheet.paste(Image.fromarray(pixels).resize((side, side), Image.NEAREST), (x, y))
            if captions:
                draw.text((x, y + side), captions[r][c], fill=TEXT)
    return sheet


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


def view_grid(
    dataset, mean: Sequence[float], std: Sequence[float], count: int = 8, side: int = 96
) -> Image.Image:
    """The first ``count`` images of ``dataset`` (an SSLDataset) as pretraining's epoch 0 sees them:
    one row per image, one column per augmented view (the crops the loss compares)."""
    rows = []
    for index in range(min(count, len(dataset))):
        crops = dataset.views((index, 0))
        rows.append([to_pixels(crop, mean, std) for crop in crops])
    return tile(rows, side)


def curves_image(
    curves: Dict[str, List[Tuple[float, float]]], x_label: str = "epoch", size: Tuple[int, int] = (320, 180)
) -> Image.Image:
    """One panel per curve, side by side: ``{title: [(x, y)...]}`` drawn as a polyline with dots,
    the y range (lowest, highest) written at the panel's left and the x range under it."""
    width, height = size
    sheet = Image.new("RGB", (len(curves) * (width + PAD) + PAD, height + 2 * PAD), BACKGROUND)
    draw = ImageDraw.Draw(sheet)
    for i, (title, points) in enumerate(curves.items()):
        _panel(draw, (PAD + i * (width + PAD), PAD, width, height), title, points, x_label)
    return sheet


def _panel(draw, where: Tuple[int, int, int, int], title: str, points, x_label: str) -> None:
    """One curve in the panel ``where`` = (left, top, width, height)."""
    left, top, width, height = where
    margin, ink = 36, (40, 90, 200)
    box = (left + margin, top + 16, left + width - 8, top + height - 20)
    draw.rectangle(box, outline=(160, 160, 160))
    draw.text((left + margin, top), title, fill=TEXT)
    if not points:
        return
    xs, ys = [p[0] for p in points], [p[1] for p in points]
    x0, x1, y0, y1 = min(xs), max(xs), min(ys), max(ys)
    draw.text((left, box[1]), f"{y1:.3g}", fill=TEXT)
    draw.text((left, box[3] - 10), f"{y0:.3g}", fill=TEXT)
    draw.text((box[0], box[3] + 4), f"{x_label} {x0:g}..{x1:g}", fill=TEXT)
    fx = [(x - x0) / (x1 - x0) if x1 > x0 else 0.5 for x in xs]
    fy = [(y - y0) / (y1 - y0) if y1 > y0 else 0.5 for y in ys]
    line = [
        (box[0] + 4 + a * (box[2] - box[0] - 8), box[3] - 4 - b * (box[3] - box[1] - 8))
        for a, b in zip(fx, fy)
    ]
    if len(line) > 1:
        draw.line(line, fill=ink, width=2)
    for x, y in line:
        draw.ellipse((x - 2, y - 2, x + 2, y + 2), fill=ink)
