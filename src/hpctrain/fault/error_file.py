"""torchrun's per-worker error file, written whole or not at all.

torchrun's agent reads a failed worker's error file (``json.load``) as soon as it sees the worker exit, and again for
the workers it then SIGTERMs; a file it cannot parse ends the agent with ``JSONDecodeError`` in place of the failure
report. torch's ``ErrorHandler.record_exception`` opens the file for writing (which empties it) and then writes. Once a
run has failed, a rank's stop-signal handlers are gone, so the agent's SIGTERM (sent because another rank failed) kills
it wherever it is: between the open and the write it leaves an empty file. CI saw exactly that: a crash of one rank of
two ended in ``JSONDecodeError: Expecting value: line 1 column 1`` instead of naming the rank. Written through a
temporary file and a rename, a reader sees a complete error or none.
"""

from __future__ import annotations

import json
import time
import traceback
from typing import Callable, TypeVar

from torch.distributed.elastic.multiprocessing.errors import ErrorHandler, record

from hpctrain.atomic import atomic_write_text

F = TypeVar("F", bound=Callable)


class AtomicErrorHandler(ErrorHandler):
    """torch's error handler with the worker's write made atomic; the file's content is torch's own format."""

    def record_exception(self, e: BaseException) -> None:
        file = self._get_error_file_path()
        if not file:
            return
        data = {"message": {"message": f"{type(e).__name__}: {e}", "extraInfo": {
            "py_callstack": traceback.format_exc(), "timestamp": str(int(time.time()))}}}
        atomic_write_text(file, json.dumps(data))


def record_errors(fn: F) -> F:
    """``torch.distributed.elastic.multiprocessing.errors.record`` with the atomic handler."""
    return record(fn, error_handler=AtomicErrorHandler())
