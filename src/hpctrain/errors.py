"""The one error type that reaches a user as a message instead of a traceback."""

from __future__ import annotations

import difflib
from typing import Iterable


class UserError(Exception):
    """Bad input (config, CLI, data, checkpoint, environment).

    The CLI prints ``str(err)`` and the hint, exits non-zero, and shows no
    traceback unless ``--debug``. The message says what is wrong; the hint says
    what to do next.
    """

    def __init__(self, message: str, hint: str = "") -> None:
        super().__init__(message)
        self.hint = hint

    def __str__(self) -> str:
        text = super().__str__()
        return f"{text}\nHINT: {self.hint}" if self.hint else text


def did_you_mean(word: str, choices: Iterable[str]) -> str:
    """' Did you mean X?' for the closest choice, or '' when none is close."""
    close = difflib.get_close_matches(word, list(choices), n=1, cutoff=0.6)
    return f" Did you mean '{close[0]}'?" if close else ""
