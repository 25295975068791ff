"""Prints images/s per core of vistrain's data pipeline beside lightly's, torchvision v2's and kornia's.

Images per second per core of the SSL data pipeline (decode, views, collate; no model), measured
side by side on the same images and the same cores:

    OMP_NUM_THREADS=1 python dev/bench/bench_pipeline.py                  # photos and ELPV, SimCLR and DINO
    OMP_NUM_THREADS=1 python dev/bench/bench_pipeline.py --data photos --recipes dino --rounds 5
    OMP_NUM_THREADS=1 python dev/bench/bench_pipeline.py --photos DIR     # your own JPEGs instead

Data: ``photos`` are crops (sides drawn from 200-600 px) of the RGB photographs bundled with
scikit-image (``skimage.data``) and scikit-learn (``load_sample_images``), saved as JPEG (quality 90)
in a temporary folder; ``elpv`` are the first cells (300 x 300 grayscale PNG) of the installed
``elpv-dataset`` package, decoded every time (the shipped ``elpv`` source decodes each cell once).

Recipes: ``simclr`` two 224 px views (scale 0.08-1, jitter strength 1, blur p 0.5); ``dino`` 2 x 224
(scale 0.4-1) + 6 x 96 (0.05-0.4), jitter strength 0.5, blur and solarisation as lightly's
DINOTransform (vistrain: one blur probability for every view, 0.5; solarisation 0.2 / 8 per view).

Pipelines, each run as one DataLoader worker runs (``num_workers=0``, one torch thread: per core):

* ``vistrain``: ``disk_folder``'s FileSource (torchvision.io for JPEGs, PIL for PNGs), ``prepare``
  per image, the views of the batch made in ``collate`` (``vistrain/data/transforms.py``); ELPV on
  its one channel, as the shipped ``elpv`` source reads it.
* ``vistrain-shards``: the same from tar shards written by ``tools/make_shards.py`` (32 per shard).
* ``lightly``: lightly 1.6.0's SimCLRTransform / DINOTransform on PIL images (RGB), default collate.
* ``tv2``: torchvision.transforms.v2 per image on uint8 tensors decoded by ``torchvision.io``.
* ``kornia``: ``torchvision.io`` decode, kornia's RandomResizedCrop per image (its views of a
  resolution in one call), kornia's colour augmentations per batch in collate.

Each round runs every pipeline once over the same images, the order rotating. Printed: medians
over rounds of images/s of wall and of process CPU time (steadier on a shared machine), CPU ms per
image of each stage and the views' cost over the decoding's; per data set, decoding by PIL against
vistrain's and how many images a reduced decode reads; that decode on the uncropped photographs.
"""

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Callable, Dict, List

import numpy as np
import torch
from PIL import Image
from torch.utils.data import DataLoader, Dataset, default_collate

from vistrain.config import get_defaults
from vistrain.data.datasets import FileSource, SSLDataset
from vistrain.data.folders import draft_fits, draft_scale
from vistrain.data.transforms import build_transform

MEAN, STD = [0.485, 0.456, 0.406], [0.229, 0.224, 0.225]
RECIPES = {  # (count, size, scale) per resolution, jitter strength, blur probs per view, solarise
    "simclr": {"crops": [(2, 224, (0.08, 1.0))], "strength": 1.0, "solarize": 0.0},
    "dino": {"crops": [(2, 224, (0.4, 1.0)), (6, 96, (0.05, 0.4))], "strength": 0.5, "solarize": 0.2},
}


# ------------------------------------------------------------------------------------------ data
PHOTOS = ["astronaut", "chelsea", "coffee", "rocket", "hubble_deep_field", "immunohistochemistry", "retina"]


def bundled_photos() -> List[np.ndarray]:
    """The RGB photographs bundled with scikit-image and scikit-learn (uint8 (H, W, 3), 300-1411 px)."""
    import skimage.data
    from sklearn.datasets import load_sample_images

    photos = [getattr(skimage.data, n)() for n in PHOTOS] + [skimage.data.stereo_motorcycle()[0]]
    return photos + list(load_sample_images().images)


def write_photos(folder: str, count: int, seed: int = 0) -> List[str]:
    """``count`` JPEGs (quality 90): random crops, sides in [200, 600], of the bundled photographs."""
    photos, rng, paths = bundled_photos(), np.random.default_rng(seed), []
    for i in range(count):
        photo = photos[i % len(photos)]
        h = min(photo.shape[0], int(rng.integers(200, 601)))
        w = min(photo.shape[1], int(rng.integers(200, 601)))
        top, left = rng.integers(0, photo.shape[0] - h + 1), rng.integers(0, photo.shape[1] - w + 1)
        paths.append(os.path.join(folder, f"photo_{i:04d}.jpg"))
        Image.fromarray(photo[top : top + h, left : left + w]).save(paths[-1], quality=90)
    return paths


def elpv_cells(folder: str, count: int) -> List[str]:
    """Links in ``folder`` to the first ``count`` cells of the installed elpv-dataset."""
    from vistrain.data.elpv import package_folder, read_labels

    paths = []
    for source in read_labels(package_folder())[0][:count]:
        paths.append(os.path.join(folder, os.path.basename(source)))
        os.symlink(source, paths[-1])
    return paths


def write_shards(folder: str, out: str) -> str:
    """Shards of ``folder`` (in its sorted order) by tools/make_shards.py; their brace pattern."""
    tool = os.path.join(os.path.dirname(__file__), "..", "..", "tools", "make_shards.py")
    command = [sys.executable, tool, folder, out, "--per-shard", "32", "--keep-order", "--name", "bench"]
    subprocess.run(command, check=True, capture_output=True)
    shards = sorted(f for f in os.listdir(out) if f.endswith(".tar"))
    return os.path.join(out, f"bench-{{000000..{len(shards) - 1:06d}}}.tar")


# ------------------------------------------------------------------------------------- pipelines
class Profile:
    """CPU seconds of this thread spent in each named stage (wrapped callables add to it)."""

    def __init__(self):
        self.seconds: Dict[str, float] = {}

    def wrap(self, name: str, fn: Callable) -> Callable:
        def timed(*args, **kwargs):
            start = time.thread_time()
            out = fn(*args, **kwargs)
            self.seconds[name] = self.seconds.get(name, 0.0) + time.thread_time() - start
            return out

        return timed


def vistrain_transforms(recipe):
    cfg = get_defaults().DATA.TRAIN.TRANSFORMS.clone()
    cfg.NUM_CROPS = [c for c, _, _ in recipe["crops"]]
    cfg.SIZE_CROPS = [s for _, s, _ in recipe["crops"]]
    cfg.CROP_SCALES = [list(sc) for _, _, sc in recipe["crops"]]
    cfg.COLOR_DISTORTION, cfg.BLUR_PROB = recipe["strength"], 0.5
    cfg.SOLARIZE_PROB = recipe["solarize"] / sum(c for c, _, _ in recipe["crops"])
    return cfg


def vistrain_loader(data, recipe, batch, profile: Profile, shards=False) -> DataLoader:
    """disk_folder's FileSource (or the shards' ShardSource) and the multicrop transform, as a run builds them."""
    cfg = vistrain_transforms(recipe)
    mode, fits = "L" if data["gray"] else "RGB", draft_fits(cfg)
    if shards:
        from vistrain.data.shards import ShardSource

        source = ShardSource(data["shards"], mode=mode, fits=fits)
    else:
        source = FileSource(list(data["paths"]), [-1] * len(data["paths"]), "disk_folder", mode, fits=fits)
    transform = build_transform(cfg)
    source.load = profile.wrap("decode", source.load)
    transform.geometry = profile.wrap("crop+resize", transform.geometry)
    transform.colour = profile.wrap("colour", transform.colour)
    transform.prepare = profile.wrap("draws", transform.prepare)
    dataset = SSLDataset([source], transform)
    collate = profile.wrap("views", dataset.collate)
    keys = [(i, 0) for i in range(len(dataset))]
    return DataLoader(dataset, batch_size=batch, sampler=keys, collate_fn=collate)


class ViewsOf(Dataset):
    """Image ``i`` read by ``read`` and turned into its views by ``views``."""

    def __init__(self, paths, read, views):
        self.paths, self.read, self.views = paths, read, views

    def __len__(self):
        return len(self.paths)

    def __getitem__(self, i):
        return self.views(self.read(self.paths[i]))


def pil_rgb(path):
    with open(path, "rb") as handle:
        return Image.open(handle).convert("RGB")


def tensor_rgb(path):
    import torchvision.io as io

    return io.decode_image(io.read_file(path), mode=io.ImageReadMode.RGB)


def lightly_loader(data, recipe, batch, profile) -> DataLoader:
    from lightly.transforms import DINOTransform, SimCLRTransform

    views = SimCLRTransform() if len(recipe["crops"]) == 1 else DINOTransform()
    dataset = ViewsOf(data["paths"], profile.wrap("decode", pil_rgb), profile.wrap("views", views))
    return DataLoader(dataset, batch_size=batch, collate_fn=default_collate)


def tv2_views(recipe):
    from torchvision.transforms import v2

    def chain(size, scale, blur, solarize):
        s = recipe["strength"]
        saturation = 0.8 * s if len(recipe["crops"]) == 1 else 0.4 * s  # SimCLR's and DINO's
        steps = [
            v2.RandomResizedCrop(size, scale=scale, antialias=True),
            v2.RandomHorizontalFlip(),
            v2.RandomApply([v2.ColorJitter(0.8 * s, 0.8 * s, saturation, 0.2 * s)], p=0.8),
            v2.RandomGrayscale(0.2),
            v2.RandomApply([v2.GaussianBlur(size // 10 * 2 + 1, sigma=(0.1, 2.0))], p=blur),
        ]
        steps += [v2.RandomSolarize(128, p=solarize)] if solarize else []
        return v2.Compose(steps + [v2.ToDtype(torch.float32, scale=True), v2.Normalize(MEAN, STD)])

    chains = []  # DINO's blur probabilities: 1.0 and 0.1 for the global views, 0.5 for the local
    for count, size, scale in recipe["crops"]:
        for _ in range(count):
            dino = len(recipe["crops"]) > 1
            blur = ([1.0, 0.1][len(chains)] if size == 224 else 0.5) if dino else 0.5
            chains.append(chain(size, scale, blur, recipe["solarize"] if len(chains) == 1 else 0.0))
    return lambda image: [c(image) for c in chains]


def tv2_loader(data, recipe, batch, profile) -> DataLoader:
    dataset = ViewsOf(
        data["paths"], profile.wrap("decode", tensor_rgb), profile.wrap("views", tv2_views(recipe))
    )
    return DataLoader(dataset, batch_size=batch, collate_fn=default_collate)


def kornia_loader(data, recipe, batch, profile) -> DataLoader:
    """torchvision.io decode, kornia's RandomResizedCrop per image (its views of a resolution in one
    call), kornia's flip and colour per batch in collate (its parameters drawn per batch)."""
    import kornia.augmentation as K

    crops = [
        (count, K.RandomResizedCrop((size, size), scale=scale)) for count, size, scale in recipe["crops"]
    ]
    s = recipe["strength"]
    saturation = 0.8 * s if len(recipe["crops"]) == 1 else 0.4 * s
    colour = [
        K.AugmentationSequential(
            K.RandomHorizontalFlip(),
            K.ColorJitter(0.8 * s, 0.8 * s, saturation, 0.2 * s, p=0.8),
            K.RandomGrayscale(p=0.2),
            K.RandomGaussianBlur((size // 10 * 2 + 1,) * 2, (0.1, 2.0), p=0.5),
            *([K.RandomSolarize(0.0, 0.0, p=recipe["solarize"] / 8)] if recipe["solarize"] else []),
            K.Normalize(torch.tensor(MEAN), torch.tensor(STD)),
        )
        for _, size, _ in recipe["crops"]
    ]

    def views(image):
        image = image.float().div_(255).unsqueeze(0)
        return [crop(image.expand(count, -1, -1, -1)) for count, crop in crops]

    def collate(samples):
        out = []
        for which, (count, _) in enumerate(crops):
            batch_views = colour[which](torch.cat([s[which] for s in samples]))
            out += batch_views.unflatten(0, (len(samples), count)).unbind(1)
        return out

    dataset = ViewsOf(data["paths"], profile.wrap("decode", tensor_rgb), profile.wrap("crop+resize", views))
    return DataLoader(dataset, batch_size=batch, collate_fn=profile.wrap("colour", collate))


PIPELINES = {
    "vistrain": vistrain_loader,
    "vistrain-shards": lambda *args: vistrain_loader(*args, shards=True),
    "lightly": lightly_loader,
    "tv2": tv2_loader,
    "kornia": kornia_loader,
}


# ----------------------------------------------------------------------------------------- timing
def one_pass(loader) -> Dict[str, float]:
    """Images per second of wall time and of this process's CPU time over one pass of ``loader``."""
    images, wall, cpu = 0, time.perf_counter(), time.process_time()
    for batch in loader:
        images += len((batch["crops"] if isinstance(batch, dict) else batch)[0])
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    return {"wall": images / wall, "cpu": images / cpu, "images": images}


def measure(args, data, name) -> Dict[str, Dict]:
    """Every pipeline over ``data`` ``args.rounds`` times, the order rotating: passes and stage profiles."""
    recipe, pipelines = RECIPES[name], [p for p in args.pipelines if p != "vistrain-shards" or data["shards"]]
    profiles = {p: Profile() for p in pipelines}
    loaders = {p: PIPELINES[p](data, recipe, args.batch, profiles[p]) for p in pipelines}
    for p in pipelines:  # warm-up: imports, first allocations, the file cache
        next(iter(loaders[p]))
        profiles[p].seconds.clear()
    runs = {p: [] for p in pipelines}
    for r in range(args.rounds):
        for p in pipelines[r % len(pipelines) :] + pipelines[: r % len(pipelines)]:
            runs[p].append(one_pass(loaders[p]))
    count = len(data["paths"]) * args.rounds
    stages = {p: {k: 1e3 * v / count for k, v in profiles[p].seconds.items()} for p in pipelines}
    return {"runs": runs, "stages": stages}


def stage_line(pipeline: str, stages: Dict[str, float]) -> str:
    """ms of CPU per image in each stage; vistrain's "views" (its collate) split into its parts."""
    stages = dict(stages)
    if "crop+resize" in stages and pipeline.startswith("vistrain"):
        stages["normalize+collate"] = stages.pop("views") - stages["crop+resize"] - stages["colour"]
    views = sum(v for k, v in stages.items() if k not in ("decode", "draws"))
    parts = ", ".join(f"{k} {v:.2f}" for k, v in stages.items())
    return f"{parts}; views / decode {views / stages['decode']:.1f}" if stages.get("decode") else parts


def report(data: dict, name: str, result: dict) -> None:
    runs = result["runs"]
    med = {p: {k: statistics.median(r[k] for r in rs) for k in ("wall", "cpu")} for p, rs in runs.items()}
    rounds = len(next(iter(runs.values())))
    print(
        f"\n{data['name']} ({len(data['paths'])} images), {name}: images/s per core, median of {rounds} rounds"
    )
    print(f"  {'pipeline':<16} {'wall':>7} {'cpu':>7} {'x lightly':>10}   ms of CPU per image by stage")
    base = med.get("lightly")
    for p in runs:
        ratio = f"{med[p]['cpu'] / base['cpu']:9.2f}x" if base else ""
        print(
            f"  {p:<16} {med[p]['wall']:7.1f} {med[p]['cpu']:7.1f} {ratio:>10}   {stage_line(p, result['stages'][p])}"
        )


# --------------------------------------------------------------------------------------- decoding
def decode_table(data: dict, recipes: List[str], repeats: int = 3) -> None:
    """ms of CPU per image: PIL against torchvision.io (what vistrain uses for JPEGs), and how many
    images each recipe's bound lets a reduced decode (PIL's draft) read at 1/2 to 1/8 size."""
    from vistrain.data.folders import read_image
    from vistrain.data.pixels import read_pixels

    def cpu_ms(fn) -> float:
        times = []
        for _ in range(repeats):
            start = time.thread_time()
            for path in data["paths"]:
                fn(path)
            times.append(time.thread_time() - start)
        return 1e3 * statistics.median(times) / len(data["paths"])

    mode = "L" if data["gray"] else "RGB"
    pil, ours = cpu_ms(lambda p: np.array(read_image(p, mode))), cpu_ms(lambda p: read_pixels(p, mode))
    sizes = [Image.open(p).size for p in data["paths"]]
    reduced = []
    for name in recipes:
        fits = draft_fits(vistrain_transforms(RECIPES[name]))
        scales = [draft_scale(w, h, fits) for w, h in sizes]
        reduced.append(f"{name} {sum(s > 1 for s in scales)}")
    print(f"\n{data['name']} decode, ms of CPU per image: PIL {pil:.2f}, vistrain {ours:.2f} ({pil / ours:.2f}x); "
          f"images a reduced decode reads: {', '.join(reduced)} of {len(sizes)}")  # fmt: skip


def draft_table(folder: str, recipes: List[str], rounds: int = 3) -> None:
    """The bundled photographs uncropped (JPEG, 300-1411 px): decode and views with the reduced
    decode where the views' bound allows, against decoding every image at full size."""
    paths = []
    for i, photo in enumerate(bundled_photos()):
        paths.append(os.path.join(folder, f"whole_{i}.jpg"))
        Image.fromarray(photo).save(paths[-1], quality=90)
    data = {"paths": paths, "gray": False, "shards": None}
    for name in recipes:
        fits = draft_fits(vistrain_transforms(RECIPES[name]))
        scales = [draft_scale(*Image.open(p).size, fits) for p in paths]
        rates = {}
        for bound in (fits, None):
            loader = vistrain_loader(data, RECIPES[name], len(paths), Profile())
            loader.dataset.sources[0].fits = bound
            next(iter(loader))
            rates[bound is None] = statistics.median(one_pass(loader)["cpu"] for _ in range(rounds))
        print(f"whole photographs ({len(paths)}, 300-1411 px), {name}: {sum(s > 1 for s in scales)} decoded at "
              f"reduced size (scales {sorted(scales)}); decode and views {1e3 / rates[True]:.1f} ms of CPU per "
              f"image at full size, {1e3 / rates[False]:.1f} ms with the reduced decode")  # fmt: skip


def main():
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--data", nargs="+", default=["photos", "elpv"], choices=["photos", "elpv"])
    parser.add_argument("--recipes", nargs="+", default=list(RECIPES), choices=list(RECIPES))
    parser.add_argument("--pipelines", nargs="+", default=list(PIPELINES), choices=list(PIPELINES))
    parser.add_argument("--images", type=int, default=64, help="images per data set")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (per core: 1)")
    parser.add_argument("--photos", default="", help="a folder of JPEGs to use instead of the bundled photos")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(
        f"torch {torch.__version__}, {args.threads} thread(s), {os.cpu_count()} cores, load {os.getloadavg()}"
    )
    with tempfile.TemporaryDirectory() as scratch:
        for name in args.data:
            folder = os.path.join(scratch, name)
            os.makedirs(folder)
            if name == "photos" and args.photos:
                paths = sorted(os.path.join(args.photos, f) for f in os.listdir(args.photos))[: args.images]
            elif name == "photos":
                paths = write_photos(folder, args.images)
            else:
                paths = elpv_cells(folder, args.images)
            shards = None
            if "vistrain-shards" in args.pipelines:
                shards = write_shards(os.path.dirname(paths[0]), os.path.join(scratch, name + "-shards"))
            data = {"name": name, "paths": paths, "gray": name == "elpv", "shards": shards}
            decode_table(data, args.recipes)
            for recipe in args.recipes:
                report(data, recipe, measure(args, data, recipe))
        if "photos" in args.data and not args.photos:
            print()
            draft_table(scratch, args.recipes)
    print(f"\nload average at the end {os.getloadavg()} (other jobs share this machine: read the ratios)")


if __name__ == "__main__":
    main()
