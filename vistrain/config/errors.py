"""The one error for "the user's input is wrong": :class:`InputError`, and the kinds it comes in.

Any layer and any rank may raise it: a bad config key or value, data that cannot be read, a
checkpoint that does not fit, a head that does not fit its trunk, a run folder that cannot be
used. Its message is one line naming the problem and the fix (the key to change where there is
one). The launcher prints ``<kind>: <message>`` once and exits 2, stopping the other ranks; any
other exception is a bug or a crash of ours and keeps its traceback (exit 1).
"""

from typing import Optional


class InputError(ValueError):
    """The user's input is wrong; ``str(error)`` is one line, ``kind`` says what input it was."""

    kind = "input error"

    def __init__(self, message: str, kind: Optional[str] = None):
        super().__init__(_original_line(str(message), type(self)))
        if kind is not None:
            self.kind = kind

    def line(self) -> str:
        """What the launcher prints: ``<kind>: <message>``."""
        return f"{self.kind}: {self}"


class ConfigError(InputError):
    """Bad config input; the message names the offending key, value or file."""

    kind = "config error"


class DataError(InputError):
    """A data source that cannot be read (missing, empty, unreadable files); the message names the file."""

    kind = "data error"


def _original_line(message: str, error_type: type) -> str:
    """``message``, or the original one where a DataLoader worker re-raised the error: torch then
    calls ``type(error)("Caught <Name> in DataLoader worker process 0.\\nOriginal Traceback ...")``,
    whose last line is ``<module>.<Name>: <the original message>``."""
    if not message.startswith(f"Caught {error_type.__name__} ") or "\nOriginal Traceback" not in message:
        return message
    last = message.rstrip().splitlines()[-1]
    _, sep, original = last.partition(f"{error_type.__name__}: ")
    return original if sep else last
