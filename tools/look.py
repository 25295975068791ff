#!/usr/bin/env python
"""Pictures of what a trained trunk learned, from its run folder (docs/look.md).

    python tools/look.py RUN_FOLDER [map] [neighbours] [attention] [duplicates] [--data train|test|FOLDER]
                         [config.LOOK.KEY=VALUE ...]

No picture named: all four. ``config.*`` items override the run's config (the ``LOOK`` keys:
vistrain/config/defaults.py). Each picture goes to RUN_FOLDER/look/ as a PNG and to the run's
TensorBoard (RUN_FOLDER/tb; its W&B run too with LOGGING.WANDB) as ``look/<name>``; with
``config.LOOK.OUTPUT_DIR=DIR`` all go to DIR (DIR/tb), and nothing is written in RUN_FOLDER. Exit codes: 0 done, 2 bad input (one line on stderr).
"""

import argparse
import sys


def parser() -> argparse.ArgumentParser:
    out = argparse.ArgumentParser(prog="python tools/look.py", description=__doc__.split("\n")[0])
    out.add_argument(
        "run_dir", metavar="RUN_FOLDER", help="a run's CHECKPOINT.DIR (its config.yaml and checkpoints)"
    )
    out.add_argument(
        "items",
        nargs="*",
        metavar="PICTURE|config.KEY=VALUE",
        help="any of map, neighbours, attention, duplicates (default: all)",
    )
    out.add_argument(
        "--data", default="", help="train or test (DATA.TRAIN, DATA.TEST), or a folder of images"
    )
    return out


def main(argv) -> int:
    args = parser().parse_intermixed_args(argv)
    from vistrain.benchmarks.look import PICTURES, Look, run_config
    from vistrain.config import OneLineExit
    from vistrain.jobs import check_values
    from vistrain.runtime.logger import RunWriter
    from vistrain.runtime.tracking import wandb_settings

    overrides = [item for item in args.items if item.startswith("config.")]
    names = [item for item in args.items if not item.startswith("config.")]
    unknown = [name for name in names if name not in PICTURES]
    if unknown:
        print(f"input error: no picture {unknown[0]!r}; valid: {', '.join(PICTURES)}", file=sys.stderr)
        return 2

    try:
        cfg = run_config(args.run_dir, overrides, args.data)
        check_values(cfg)  # every value, the data and the trunk, as a job's are checked
        look = Look(cfg)
        # the run's TensorBoard (and W&B run, with LOGGING.WANDB); with LOOK.OUTPUT_DIR (a run folder
        # not to write to) their own there
        with RunWriter(cfg.LOOK.OUTPUT_DIR or args.run_dir, wandb_settings(cfg)) as writer:
            look.draw(names or list(PICTURES), writer)
    except OneLineExit as error:
        print(error.line(), file=sys.stderr)
        return error.exit_code
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
