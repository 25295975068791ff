#!/usr/bin/env python
"""Write tar shards with their indexes from an image folder, for ``DATA_SOURCES: [webdataset]``.

    python tools/make_shards.py FOLDER OUT [--per-shard N] [--max-bytes BYTES] [--name NAME]
                                [--labels auto|subfolders|none] [--seed S | --keep-order]
    python tools/make_shards.py --index-only 'SHARDS/train-{000000..000099}.tar'

FOLDER is read as ``disk_folder`` reads it (``--labels`` as ``FOLDER_LABELS``): class subfolders
give each sample a ``cls`` member, the index of its class in the sorted names (listed in
``OUT/NAME-classes.txt``); unlabelled images get none. Each image is stored as its file's bytes (no
re-encoding) under a key made of its path below FOLDER, in a random order (``--seed``): a rank reads
its shards in stretches and shuffles only within ``SHUFFLE_WINDOW``, so shards in class order would
give batches of one class; ``--keep-order`` keeps the folder's order. A shard ends after
``--per-shard`` samples or once it holds ``--max-bytes`` of images (default 500 MB), whichever comes
first; shards are ``OUT/NAME-000000.tar``, ... (NAME: FOLDER's name), each with ``<shard>.index.json``.
``--index-only`` writes the indexes of shards made by other tools (webdataset's ``ShardWriter``,
``tar``), which vistrain needs to read them. Prints what it wrote and the config lines to paste.
Exit codes: 0 done, 2 bad input (one line on stderr).
"""

import argparse
import glob
import os
import random
import sys
import time


def main(argv) -> int:
    args = _parser().parse_args(argv)
    from vistrain.config import OneLineExit

    try:
        if args.index_only:
            _index_only(args.index_only)
        elif args.folder and args.out:
            _write(args)
        else:
            _parser().error("give FOLDER and OUT, or --index-only PATTERN")
    except OneLineExit as e:
        print(e.line(), file=sys.stderr)
        return e.exit_code
    return 0


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python tools/make_shards.py", description=__doc__.split("\n")[0].strip("`")
    )
    parser.add_argument("folder", nargs="?", help="image folder (class subfolders, or images at any depth)")
    parser.add_argument("out", nargs="?", help="folder the shards are written to")
    parser.add_argument(
        "--per-shard", type=int, default=0, metavar="N", help="samples per shard (0: no limit)"
    )
    parser.add_argument("--max-bytes", type=float, default=5e8, help="image bytes per shard (default 5e8)")
    parser.add_argument("--name", default="", help="shard name prefix (default: FOLDER's name)")
    parser.add_argument(
        "--labels", default="auto", choices=("auto", "subfolders", "none"), help="as FOLDER_LABELS"
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of the samples' random order")
    parser.add_argument("--keep-order", action="store_true", help="keep the folder's sorted order")
    parser.add_argument("--index-only", metavar="PATTERN", help="index existing shards (a brace pattern)")
    return parser


def _write(args) -> None:
    from vistrain.config import ConfigError, DataError
    from vistrain.data.folders import scan_disk_folder
    from vistrain.data.shards import require_webdataset, write_index

    webdataset = require_webdataset()
    folder, out = os.path.expanduser(args.folder), os.path.expanduser(args.out)
    if not os.path.isdir(folder):
        raise DataError(f"make_shards: folder not found: {folder}")
    subdirs = {e.name for e in os.scandir(folder) if e.is_dir()}
    if {"train", "val"} <= subdirs:
        raise DataError(
            f"make_shards: {folder} holds train/ and val/; make shards of each: FOLDER/train OUT, FOLDER/val OUT"
        )
    if args.per_shard < 0 or args.max_bytes <= 0:
        raise ConfigError("make_shards: --per-shard must be >= 0 and --max-bytes > 0")
    name = args.name or os.path.basename(os.path.normpath(os.path.abspath(folder)))
    paths, labels = scan_disk_folder(folder, args.labels)
    os.makedirs(out, exist_ok=True)
    if glob.glob(os.path.join(glob.escape(out), f"{glob.escape(name)}-*.tar")):
        raise DataError(f"make_shards: {out} already holds {name}-*.tar shards; choose another OUT or --name")
    order = list(range(len(paths)))
    if not args.keep_order:
        random.Random(args.seed).shuffle(order)
    keys = _keys(paths, folder)
    shards, progress = [], _Progress(len(paths))
    with webdataset.ShardWriter(
        os.path.join(out, f"{name}-%06d.tar"),
        maxcount=args.per_shard or len(paths),
        maxsize=args.max_bytes,
        post=lambda shard: shards.append((shard, write_index(shard))),
        verbose=0,
        encoder=False,  # the file's bytes as they are
        format="PAX_FORMAT",  # any key length
        mtime=int(time.time()),  # whole seconds: a float would add a PAX header to every member
    ) as sink:
        for i in order:
            with open(paths[i], "rb") as handle:
                sample = {"__key__": keys[i][0], keys[i][1]: handle.read()}
            if labels[i] >= 0:
                sample["cls"] = str(labels[i]).encode()
            sink.write(sample)
            progress.update(len(sample[keys[i][1]]))
    progress.close()
    classes = sorted(e for e in subdirs if not e.startswith(".")) if labels[0] >= 0 else []
    if classes:
        with open(os.path.join(out, f"{name}-classes.txt"), "w") as handle:
            handle.write("".join(c + "\n" for c in classes))
    _report(out, name, shards, classes, progress.bytes)


def _keys(paths, folder):
    """(key, extension) per image: its path below ``folder`` without the extension, dots of the
    file name made underscores (webdataset's key ends at the name's first dot), unique."""
    keys, seen = [], set()
    for path in paths:
        stem, ext = os.path.splitext(os.path.relpath(path, folder))
        parent, base = os.path.split(stem)
        key = "/".join([*parent.split(os.sep), base.replace(".", "_")]) if parent else base.replace(".", "_")
        unique, n = key, 1
        while unique in seen:
            n += 1
            unique = f"{key}_{n}"
        seen.add(unique)
        keys.append((unique, ext[1:].lower()))
    return keys


def _report(out, name, shards, classes, image_bytes) -> None:
    from vistrain.config.words import plural

    samples = sum(len(index["keys"]) for _, index in shards)
    tar_bytes = sum(os.path.getsize(shard) for shard, _ in shards)
    listed = (
        f", {plural(len(classes), 'class', 'classes')} ({os.path.join(out, name)}-classes.txt)"
        if classes
        else ", unlabelled"
    )
    print(
        f"wrote {plural(len(shards), 'shard')} to {out}: {plural(samples, 'sample')}{listed}, "
        f"{_size(image_bytes)} of images in {_size(tar_bytes)} of shards"
    )
    last = len(shards) - 1
    pattern = os.path.join(
        os.path.abspath(out), f"{name}-{{000000..{last:06d}}}.tar" if last else f"{name}-000000.tar"
    )
    print(f'config lines: DATA_SOURCES: [webdataset]  DATA_PATHS: ["{pattern}"]')
    print(
        f"as overrides: config.DATA.TRAIN.DATA_SOURCES=[webdataset] 'config.DATA.TRAIN.DATA_PATHS=[\"{pattern}\"]'"
    )


def _index_only(pattern: str) -> None:
    from vistrain.config.words import plural
    from vistrain.data.shards import expand_pattern, write_index

    shards = expand_pattern(pattern)
    missing = [s for s in shards if not os.path.isfile(s)]
    if missing:
        from vistrain.config import DataError

        raise DataError(
            f"make_shards: {plural(len(missing), 'shard')} of {pattern} not found, e.g. {missing[0]}"
        )
    indexes = [write_index(shard) for shard in shards]
    samples = sum(len(index["keys"]) for index in indexes)
    skipped = sum(index["skipped"] for index in indexes)
    note = f" ({plural(skipped, 'key')} without an image member left out)" if skipped else ""
    print(f"indexed {plural(len(shards), 'shard')}: {plural(samples, 'sample')}{note}")


class _Progress:
    """A one-line progress bar on stderr (redrawn at most 5 times a second, only on a terminal)."""

    def __init__(self, total: int):
        self.total, self.done, self.bytes, self.drawn = total, 0, 0, 0.0
        self.live = sys.stderr.isatty()

    def update(self, nbytes: int) -> None:
        self.done, self.bytes = self.done + 1, self.bytes + nbytes
        if self.live and (time.monotonic() - self.drawn > 0.2 or self.done == self.total):
            filled = 30 * self.done // self.total
            bar = "#" * filled + "." * (30 - filled)
            print(
                f"\r[{bar}] {self.done:,}/{self.total:,} images, {_size(self.bytes)}", end="", file=sys.stderr
            )
            self.drawn = time.monotonic()

    def close(self) -> None:
        if self.live:
            print(file=sys.stderr)


def _size(nbytes: int) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if nbytes >= scale:
            return f"{nbytes / scale:.1f} {unit}"
    return f"{nbytes} bytes"


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
