"""``tools/run_distributed.py``: the command line around :func:`vistrain.distributed.launch`.

Every outcome but a rank's own failure is one line on stderr, never a traceback, printed once per
job (by the launcher, or by global rank 0 of a torchrun / srun job):

    exit 0    done (or --help)
    exit 1    a rank failed: its traceback follows "run failed:"
    exit 2    the input is wrong (an InputError): no arguments or no config=, a bad config key or value, a run
              folder in use or unusable, data or a model that cannot work; found before anything
              started (nothing written) or by a rank (every rank stopped, the folder resumable)
    exit 3    the run diverged (NaN/inf): names the iteration and the last good checkpoint
    exit 130  interrupted (Ctrl-C): every rank stopped; names the last complete checkpoint
    exit 143  stopped by SIGTERM or SIGUSR1 (a scheduler): every rank stopped at an iteration
              boundary and saved it; names the checkpoint the same command resumes from

While it works it says what it is doing (checking, planning, starting the ranks) on stdout.
Importing this module does not load torch: a typo is answered at once. The config is checked in
two steps: every key and value that needs neither the registries nor the methods' sections
(``vistrain.config``, no torch), then the whole config with every method's keys, rules and checks,
the registries and the probes of data, model and run folder (``vistrain.jobs.checked_config``).
"""

import contextlib
import functools
import os
import signal
import sys
import threading
import time
from typing import Iterator, List, Sequence

from vistrain.config import OneLineExit, StopRequested, available_configs, load_config, require_recipe
from vistrain.config.checks import check_plain_values
from vistrain.config.job_env import job_rank

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
            "every key, its default and meaning: vistrain/config/defaults.py and a method's file in "
            "vistrain/methods/; allowed values: vistrain/config/checks.py; docs/getting-started.md, "
            "section Configs",
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
    cfg = None
    try:
        with _stop_signals_before_start():
            cfg = load_config(argv)  # the methods' sections held open: no torch yet
            require_recipe(argv)  # after load_config: a typo in a key is the more useful line
            check_plain_values(cfg)
            say(f"checking the config, its data and CHECKPOINT.DIR {cfg.CHECKPOINT.DIR} (loading torch)")
            from vistrain.jobs import (
                check_run_folder,
                checked_config,
                fitted_warmups,
                get_job,
                normalized_config,
                training_samples,
            )

            cfg = checked_config(argv)
            samples = training_samples(cfg)
            cfg, fitted = fitted_warmups(cfg, samples)
            cfg, normalized = normalized_config(cfg)
            check_run_folder(cfg, samples)
            job, notes = get_job(cfg.JOB), []
            for note in (fitted, normalized):
                if note:
                    say(note)
                    notes.append(note)
            if cfg.JOB == "train" and cfg.MODEL.FSDP_CONFIG.AUTO_TUNE:
                say(
                    "planning the memory per rank of each setting of the exact knobs (MODEL.FSDP_CONFIG.AUTO_TUNE)"
                )
                cfg, job = _auto_tuned(cfg, job, argv, notes)
            elif notes and cfg.JOB == "train":
                job = functools.partial(job, notes=tuple(notes))
    except OneLineExit as e:
        return _refuse(e, cfg)
    return run(job, cfg)


@contextlib.contextmanager
def _stop_signals_before_start() -> Iterator[None]:
    """SIGTERM / SIGUSR1 while the config is checked, the memory planned and the launcher starts:
    stop in one line, nothing started (the launcher and the ranks install their own handlers
    inside, see ``vistrain.distributed.stop_signals``)."""
    if threading.current_thread() is not threading.main_thread():  # only it may set handlers
        yield
        return

    received: List[str] = []

    def stopped() -> StopRequested:
        return StopRequested(f"{received[0]} before the run started; nothing was written")

    def stop(signum, frame):
        received.append(signal.Signals(signum).name)
        raise stopped()

    previous = {sig: signal.signal(sig, stop) for sig in (signal.SIGTERM, signal.SIGUSR1)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if received:  # the raise landed in code that swallows exceptions (torch's import has such blocks)
        raise stopped()


def say(text: str) -> None:
    """What the command is doing, on stdout, from the process that speaks for the job."""
    if job_rank(os.environ) == 0:
        print(f"[{time.strftime('%H:%M:%S')} vistrain] {text}", flush=True)


def _auto_tuned(cfg, job, argv, notes: List[str]):
    """``cfg`` with the knobs ``vistrain.planner.auto_tune`` chose, and the job logging ``notes``
    and the details."""
    from vistrain.planner.auto_tune import summary_line, tune_job

    tuned = tune_job(cfg, argv, launcher=True)  # it imported the job's module: what a rank imports
    if tuned.across_nodes:  # the ranks choose the shard group size once they know the link
        say(
            "auto-tune: the job spans nodes; the ranks time the link, then choose the shard group size (details in log.txt)"
        )
        choices = (tuned.across_nodes, tuned.layout)
        return tuned.cfg, functools.partial(job, notes=(*notes, tuned.line), across_nodes=choices)
    say(summary_line(cfg, tuned.cfg, tuned.line))
    return tuned.cfg, functools.partial(job, notes=(*notes, tuned.line))


def run(job, cfg) -> int:
    """Launch ``job`` (a module-level function of cfg) on every rank; the exit code (docstring)."""
    from vistrain.distributed.launch import RankFailedError, launch

    say("starting the ranks: each builds the model and reads the data")
    try:
        # until the launcher (or the rank, in-process) installs its own answer to SIGTERM / SIGUSR1
        with _stop_signals_before_start():
            launch(job, cfg, announce=functools.partial(announce_stop, cfg), may_fork=True)
    except OneLineExit as e:  # bad input, divergence, a stop signal: found by the launcher or a rank
        return _report(e, cfg)
    except RankFailedError as e:
        print(f"run failed: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        _exit_interrupted(cfg.CHECKPOINT.DIR)
    return 0


def _refuse(error: OneLineExit, cfg) -> int:
    """An error found before the job started: one line from the process that speaks for the job
    (in torchrun / srun, the ranks agree first: ``vistrain.distributed.launch.refuse_in_job``)."""
    if job_rank(os.environ) == 0:  # answered before torch is loaded
        print(error.line(), file=sys.stderr)
        return error.exit_code
    from vistrain.distributed.launch import refuse_in_job

    refuse_in_job(error, cfg)
    return _leave(error.exit_code)


def _report(error: OneLineExit, cfg) -> int:
    """The job's one line for ``error`` (printed by one process per job), then its exit code."""
    from vistrain.distributed.launch import report_for_job

    if isinstance(error, StopRequested):
        line = stop_line(cfg, str(error))
    else:
        line = error.line()
    report_for_job(line, os.environ, error.agreed)
    return _leave(error.exit_code)


def _leave(code: int) -> int:
    """``code``; a rank of a joined job whose process group still lives leaves at once instead:
    interpreter teardown with peers gone can abort with C++ "terminate called" noise."""
    from vistrain.distributed import comm

    if comm.is_dist() and comm.get_world_size() > 1:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code


def stop_line(cfg, detail: str) -> str:
    """The line of a job stopped by a signal: what happened (``detail``) and where the same command
    continues from (with AUTO_RESUME off a rerun would start afresh: the line says so)."""
    if cfg.JOB != "train":
        return f"stopped: {detail}; rerun the same command to run it again"
    from vistrain.checkpoint import find_latest_checkpoint

    run_dir = cfg.CHECKPOINT.DIR
    latest = find_latest_checkpoint(run_dir)
    if not latest:
        resume = f"no checkpoint in {run_dir} yet"
    elif cfg.CHECKPOINT.AUTO_RESUME:
        resume = f"rerun the same command to resume from {latest}"
    else:
        resume = f"rerun with config.CHECKPOINT.AUTO_RESUME=True to resume from {latest}"
    return f"stopped: {detail}; {resume}"


def announce_stop(cfg, detail: str) -> None:
    """Print the job's stop line (the rank that ends the process when a stop's grace runs out)."""
    print(stop_line(cfg, detail), file=sys.stderr, flush=True)


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
