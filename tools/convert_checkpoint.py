#!/usr/bin/env python
"""Inspect or convert a vistrain checkpoint (a checkpoint folder, or a run folder: its latest).

    python tools/convert_checkpoint.py RUN_OR_CHECKPOINT --inspect
    python tools/convert_checkpoint.py RUN_OR_CHECKPOINT --to-consolidated model.pt
    python tools/convert_checkpoint.py RUN_OR_CHECKPOINT --to-torchvision regnet.pt
    python tools/convert_checkpoint.py RUN_OR_CHECKPOINT --to-timm vit.pt [--teacher]
    python tools/convert_checkpoint.py RUN_OR_CHECKPOINT --to-safetensors trunk.safetensors [--eval DIR ...]

--to-consolidated writes one plain state dict (``model.load_state_dict(torch.load(f))``).
--to-torchvision, --to-timm and --to-safetensors write the trunk alone, as its torchvision model's
state dict, as the state dict ``timm.create_model(name, num_classes=0, checkpoint_path=OUT)``
loads, or in its family's library's keys as a .safetensors file (an OUT ending in .safetensors is
written so by the first two as well); --teacher exports the momentum teacher's trunk. Beside OUT
goes a model card, OUT without its suffix + .README.md: the lines that load the file, the
method, data and epochs, and the top-1 of the evaluations of the run (folders beside it, and
--eval DIR). Exit codes: 0 done, 2 bad input (one line on stderr).
"""

import argparse
import os
import sys


def main(argv) -> int:
    args = _parser().parse_args(argv)
    from vistrain.checkpoint import CheckpointError
    from vistrain.config import OneLineExit

    try:
        _run(args)
    except OneLineExit as e:  # the launcher's lines: "checkpoint error: ..."
        print(e.line(), file=sys.stderr)
        return e.exit_code
    except OSError as e:
        from vistrain.checkpoint.model_card import card_path

        out = _out(args)
        written = [os.path.abspath(p) for p in (out, card_path(out))] if out else []
        if e.filename and any(os.path.abspath(e.filename).startswith(p) for p in written):
            unwritable = (
                e.filename if os.path.abspath(e.filename) == written[1] else out
            )  # OUT or OUT.tmp: OUT
            print(f"input error: {_unwritable(unwritable, e)}", file=sys.stderr)
        elif isinstance(e, FileNotFoundError):
            print(
                CheckpointError(f"{e.filename or args.checkpoint}: no such file or folder").line(),
                file=sys.stderr,
            )
        else:
            print(f"input error: {e.filename}: {e.strerror}", file=sys.stderr)
        return 2
    return 0


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("checkpoint", help="checkpoint_<n> folder, run folder, or a .pt / .safetensors file")
    action = parser.add_mutually_exclusive_group(required=True)
    action.add_argument("--inspect", action="store_true", help="print what the checkpoint holds")
    action.add_argument("--to-consolidated", metavar="OUT.pt", help="write one plain state-dict file")
    action.add_argument(
        "--to-torchvision", metavar="OUT", help="write the trunk as its torchvision model's state dict"
    )
    action.add_argument("--to-timm", metavar="OUT", help="write the trunk as its timm model's state dict")
    action.add_argument(
        "--to-safetensors",
        metavar="OUT.safetensors",
        help="write the trunk in its library's keys as safetensors",
    )
    parser.add_argument("--teacher", action="store_true", help="export the momentum teacher's trunk")
    parser.add_argument(
        "--eval", nargs="+", default=[], metavar="DIR", help="evaluation run folders for the card"
    )
    return parser


def _out(args) -> str:
    return args.to_consolidated or args.to_torchvision or args.to_timm or args.to_safetensors or ""


def _run(args) -> None:
    from vistrain.checkpoint import consolidate, describe, to_safetensors, to_timm, to_torchvision
    from vistrain.checkpoint.model_card import read_evaluation, write_card
    from vistrain.config import InputError
    from vistrain.config.words import plural

    exports = {"to_torchvision": to_torchvision, "to_timm": to_timm, "to_safetensors": to_safetensors}
    chosen = next((name for name in exports if getattr(args, name)), None)
    if chosen is None and (args.teacher or args.eval):
        raise InputError("--teacher and --eval go with --to-torchvision, --to-timm or --to-safetensors")
    if args.inspect:
        print(describe(args.checkpoint))
    elif args.to_consolidated:
        count = consolidate(args.checkpoint, args.to_consolidated)
        print(f"wrote {plural(count, 'tensor')} to {args.to_consolidated}")
    else:
        evaluations = [read_evaluation(folder) for folder in args.eval]  # before writing anything
        export = exports[chosen](args.checkpoint, getattr(args, chosen), args.teacher)
        card = write_card(export, evaluations)
        print(
            f"wrote the {export.network}'s trunk, {plural(len(export.specs), 'tensor')} in {export.library}'s "
            f"keys, to {export.out}; model card (how to load it, training, evaluations): {card}"
        )


def _unwritable(path: str, error: OSError) -> str:
    """Why ``path`` cannot be written, naming its folder, and the fix."""
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        return f"cannot write {path}: its folder {folder} does not exist; create it or choose another path"
    return f"cannot write {path}: making a file in {folder} fails ({error.strerror}); choose another path"


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
