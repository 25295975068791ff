#!/usr/bin/env python
"""Inspect or convert a vistrain checkpoint (a checkpoint folder, or a run folder: its latest).

    python tools/convert_checkpoint.py RUN_OR_CHECKPOINT --inspect
    python tools/convert_checkpoint.py RUN_OR_CHECKPOINT --to-consolidated model.pt
    python tools/convert_checkpoint.py RUN_OR_CHECKPOINT --to-torchvision regnet.pt

--to-consolidated writes one plain state dict (``model.load_state_dict(torch.load(f))``);
--to-torchvision writes the trunk as the state dict of its torchvision model (RegNet, ResNet, ViT):
load it with ``tv.fc = nn.Identity(); tv.load_state_dict(sd, strict=True)`` (a ViT: ``tv.heads``).
Exit codes: 0 done, 2 bad input (one line on stderr).
"""

import argparse
import os
import sys


def main(argv) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("checkpoint", help="checkpoint_<n> folder, run folder, or consolidated .pt file")
    action = parser.add_mutually_exclusive_group(required=True)
    action.add_argument("--inspect", action="store_true", help="print what the checkpoint holds")
    action.add_argument("--to-consolidated", metavar="OUT.pt", help="write one plain state-dict file")
    action.add_argument(
        "--to-torchvision", metavar="OUT.pt", help="write the trunk as its torchvision model's state dict"
    )
    args = parser.parse_args(argv)

    from vistrain.checkpoint import CheckpointError, consolidate, describe, to_torchvision
    from vistrain.config import OneLineExit
    from vistrain.config.words import plural

    try:
        if args.inspect:
            print(describe(args.checkpoint))
        elif args.to_consolidated:
            count = consolidate(args.checkpoint, args.to_consolidated)
            print(f"wrote {plural(count, 'tensor')} to {args.to_consolidated}")
        else:
            state = to_torchvision(args.checkpoint, args.to_torchvision)
            print(
                f"wrote {plural(len(state), 'trunk tensor')} to {args.to_torchvision} (set fc, or a ViT's heads, to nn.Identity() before loading)"
            )
    except OneLineExit as e:  # the launcher's lines: "checkpoint error: ..."
        print(e.line(), file=sys.stderr)
        return e.exit_code
    except OSError as e:
        out = args.to_consolidated or args.to_torchvision
        if out and e.filename and os.path.abspath(e.filename).startswith(os.path.abspath(out)):
            print(f"input error: {_unwritable(out, e)}", file=sys.stderr)  # OUT.pt (or OUT.pt.tmp)
        elif isinstance(e, FileNotFoundError):
            print(
                CheckpointError(f"{e.filename or args.checkpoint}: no such file or folder").line(),
                file=sys.stderr,
            )
        else:
            print(f"input error: {e.filename}: {e.strerror}", file=sys.stderr)
        return 2
    return 0


def _unwritable(out: str, error: OSError) -> str:
    """Why ``out`` cannot be written, naming its folder, and the fix."""
    folder = os.path.dirname(os.path.abspath(out))
    if not os.path.isdir(folder):
        return f"cannot write {out}: its folder {folder} does not exist; create it or choose another path"
    return f"cannot write {out}: making a file in {folder} fails ({error.strerror}); choose another path"


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
