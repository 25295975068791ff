"""Counted nouns in messages: ``plural(1, "epoch")`` -> "1 epoch", ``plural(3, "epoch")`` -> "3 epochs"."""


def plural(count, noun: str, plural_form: str = "") -> str:
    """``count`` and ``noun``, the noun in its plural form unless ``count`` is 1 (formatted with
    thousands separators; floats as ``:g``). ``plural_form`` defaults to ``noun + "s"``."""
    shown = f"{count:,}" if isinstance(count, int) else f"{count:g}"
    return f"{shown} {noun if count == 1 else plural_form or noun + 's'}"
