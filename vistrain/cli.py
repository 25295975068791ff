"""``tools/run_distributed.py``: the command line around :func:`vistrain.distributed.launch`.

Every outcome but a rank's own failure is one line on stderr, never a traceback:

    exit 0    done (or --help)
    exit 1    a rank failed: its traceback follows "run failed:"
    exit 2    the input is wrong (an InputError): no arguments, a bad config key or value, a run
              folder in use or unusable, data or a model that cannot work; found before anything
              started (nothing written) or by a rank (every rank stopped, the folder resumable)
    exit 130  interrupted (Ctrl-C): every rank stopped; names the last complete checkpoint

Importing this module does not load torch: a typo is answered at once.
"""

import functools
import os
import sys
from typing import List, Sequence

from vistrain.config import InputError, available_configs, load_config
from vistrain.config.checks import check_config

COMMAND = "python tools/run_distributed.py"
EXIT_REFUSED, EXIT_INTERRUPTED = 2, 130


def usage() -> str:
    """The command form, the shipped configs, and where the keys are documented."""
    return "\n".join(
        [
            f"usage: {COMMAND} config=NAME [config.SECTION.KEY=VALUE ...]",
            "",
            "  config=NAME           a shipped recipe (below) or a path to a .yaml file",
            "  config.A.B=VALUE      override any key; VALUE is a YAML literal, checked against the default",
            "",
            "shipped configs: " + ", ".join(available_configs()),
            "every key, its default and meaning: vistrain/config/defaults.py; allowed values: "
            "vistrain/config/checks.py; docs/getting-started.md, section Configs",
            f"example: {COMMAND} config=regnet_fsdp config.OPTIMIZER.num_epochs=2",
        ]
    )


def main(argv: Sequence[str]) -> int:
    try:
        return _main(argv)
    except KeyboardInterrupt:  # while loading and checking: nothing started, nothing written
        print("interrupted before the run started", file=sys.stderr)
        return EXIT_INTERRUPTED


def _main(argv: Sequence[str]) -> int:
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(usage(), file=sys.stdout if argv else sys.stderr)
        return 0 if argv else EXIT_REFUSED
    try:
        cfg = load_config(argv)
        check_config(cfg, _catalog)
        from vistrain.jobs import get_job

        job = get_job(cfg.JOB)
        if cfg.JOB == "train" and cfg.MODEL.FSDP_CONFIG.AUTO_TUNE:
            cfg, job = _auto_tuned(cfg, job, argv)
    except InputError as e:
        return _refuse(e.line())
    return run(job, cfg)


def _auto_tuned(cfg, job, argv):
    """``cfg`` with the knobs ``vistrain.planner.auto_tune`` chose, and the job logging its line."""
    from vistrain.fsdp.memory import current_rss_mib
    from vistrain.planner.auto_tune import tune_job

    # this process imported what a rank imports (the job's module): its RSS is a rank's baseline
    tuned = tune_job(cfg, argv, baseline_mib=current_rss_mib())
    if tuned.across_nodes:  # the ranks choose the shard group size once they know the link
        choices = (tuned.across_nodes, tuned.layout)
        return tuned.cfg, functools.partial(job, notes=(tuned.line,), across_nodes=choices)
    return tuned.cfg, functools.partial(job, notes=(tuned.line,))


def _catalog():
    """The registries config values are checked against; imported only when a check needs them."""
    from vistrain.jobs import catalog

    return catalog()


def run(job, cfg) -> int:
    """Launch ``job`` (a module-level function of cfg) on every rank; the exit code (docstring)."""
    from vistrain.distributed.launch import RankFailedError, launch

    try:
        launch(job, cfg)
    except InputError as e:  # impossible settings, a busy folder, or bad input found by a rank
        return _refuse(e.line())
    except RankFailedError as e:
        print(f"run failed: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        _exit_interrupted(cfg.CHECKPOINT.DIR)
    return 0


def _refuse(line: str) -> int:
    print(line, file=sys.stderr)
    return EXIT_REFUSED


def _exit_interrupted(run_dir: str) -> None:
    """One line, then leave at once: interpreter teardown of a live process group (in-process
    single rank) can abort with C++ "terminate called" noise; the kernel frees the lock anyway."""
    from vistrain.checkpoint import find_latest_checkpoint

    unreadable: List = []
    latest = find_latest_checkpoint(run_dir, unreadable)
    where = f"last complete checkpoint: {latest}" if latest else f"no complete checkpoint in {run_dir} yet"
    print(f"interrupted: all ranks stopped; {where}", file=sys.stderr)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(EXIT_INTERRUPTED)
