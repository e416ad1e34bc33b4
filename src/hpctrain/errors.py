"""The one error type that reaches a user as a message instead of a traceback."""

from __future__ import annotations

import difflib
from typing import Iterable, TypeVar

E = TypeVar("E", bound=BaseException)


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


def on_every_rank(err: E) -> E:
    """Mark an error that every rank raises at the same point, after a collective that shared
    the verdict (e.g. a failed checkpoint write). Teardown may then meet all ranks at a barrier
    before leaving the process group, as on success; for any other error it must not, since a
    peer may be gone."""
    err.on_every_rank = True  # type: ignore[attr-defined]
    return err


def raised_on_every_rank(err: BaseException) -> bool:
    return bool(getattr(err, "on_every_rank", False))


def agreed_on_every_rank(err: E) -> E:
    """on_every_rank, and known to be: the verdict came out of a collective, so every rank holds this very error
    and one rank (rank 0) may say it for all. An error the program's structure makes every rank raise alike
    (misuse of an API) is not known to be: rank-dependent code may raise it on one rank only."""
    err.agreed = True  # type: ignore[attr-defined]
    return on_every_rank(err)


def agreed(err: BaseException) -> bool:
    return bool(getattr(err, "agreed", False))


def did_you_mean(word: str, choices: Iterable[str]) -> str:
    """' Did you mean X?' for the closest choice, or '' when none is close."""
    close = difflib.get_close_matches(word, list(choices), n=1, cutoff=0.6)
    return f" Did you mean '{close[0]}'?" if close else ""
