"""Ways a run ends in one line: :class:`InputError` ("your input is wrong") and its kinds, a run
that diverged, a run stopped by a signal.

Any layer and any rank may raise them. The message is one line naming the problem and the fix (the
key to change where there is one). The launcher prints ``<kind>: <message>`` once per job and exits
with the error's ``exit_code``, stopping the other ranks; any other exception is a bug or a crash of
ours and keeps its traceback (exit 1).

    exit 2    InputError: a bad config key or value, unreadable data, a checkpoint that does not fit
    exit 3    DivergedError: the loss or the weights became NaN/inf (the last good checkpoint is kept)
    exit 143  StopRequested: SIGTERM / SIGUSR1 (a scheduler's preemption or time limit) stopped the run
"""

from typing import Optional

EXIT_INPUT, EXIT_DIVERGED, EXIT_STOPPED = 2, 3, 143


class OneLineExit(Exception):
    """A run that ends early for a reason the user can act on: ``str(error)`` is one line, ``kind``
    its prefix, ``exit_code`` what the command returns."""

    kind = "stopped"
    exit_code = 1

    def __init__(
        self, message: str, kind: Optional[str] = None, exit_code: Optional[int] = None, agreed: bool = False
    ):
        """``agreed``: every rank raises the same error at the same point (a collective found it),
        so global rank 0 alone reports it."""
        super().__init__(_original_line(str(message), type(self)))
        if kind is not None:
            self.kind = kind
        if exit_code is not None:
            self.exit_code = exit_code
        self.agreed = agreed

    def line(self) -> str:
        """What the launcher prints: ``<kind>: <message>``."""
        return f"{self.kind}: {self}"


class InputError(OneLineExit, ValueError):
    """The user's input is wrong; ``str(error)`` is one line, ``kind`` says what input it was."""

    kind = "input error"
    exit_code = EXIT_INPUT


class ConfigError(InputError):
    """Bad config input; the message names the offending key, value or file."""

    kind = "config error"


class DataError(InputError):
    """A data source that cannot be read (missing, empty, unreadable files); the message names the file."""

    kind = "data error"


class DivergedError(OneLineExit):
    """The loss or the weights became NaN/inf; the message names the iteration, the value, the last
    good checkpoint (nothing after it was saved) and what to change."""

    kind = "diverged"
    exit_code = EXIT_DIVERGED


class StopRequested(OneLineExit):
    """A signal (SIGTERM, SIGUSR1) asked the job to end; the message names the checkpoint to resume from."""

    kind = "stopped"
    exit_code = EXIT_STOPPED


def rebuilt(kind: str, message: str, exit_code: int, agreed: bool = False) -> OneLineExit:
    """The error a rank reported (``kind``, ``message``, ``exit_code``), raised again elsewhere."""
    cls = {EXIT_INPUT: InputError, EXIT_DIVERGED: DivergedError, EXIT_STOPPED: StopRequested}.get(
        exit_code, OneLineExit
    )
    return cls(message, kind=kind, exit_code=exit_code, agreed=agreed)


def _original_line(message: str, error_type: type) -> str:
    """``message``, or the original one where a DataLoader worker re-raised the error: torch then
    calls ``type(error)("Caught <Name> in DataLoader worker process 0.\\nOriginal Traceback ...")``,
    whose last line is ``<module>.<Name>: <the original message>``."""
    if not message.startswith(f"Caught {error_type.__name__} ") or "\nOriginal Traceback" not in message:
        return message
    last = message.rstrip().splitlines()[-1]
    _, sep, original = last.partition(f"{error_type.__name__}: ")
    return original if sep else last
