"""End an hpctrain process without the interpreter's finalization, where torch's own threads can abort it.

A torch thread that touches a Python object while CPython finalizes (a gloo worker finishing an async
collective whose tensors own their Python objects, a thread whose native thread-local state holds one, a
daemon thread inside an operator) takes the interpreter lock; during finalization CPython 3.11 answers with
pthread_exit, whose unwinding through a C++ destructor (implicitly noexcept) calls std::terminate:
"terminate called without an active exception", SIGABRT, exit code 134 instead of the run's own. That is
pytorch/pytorch#38228, #117762 and #190489, still open for torch 2.14 (the guard checks Py_IsInitialized,
which stays true while finalizing). It hit finished one-process runs after their last async checkpoint, and
a rank that failed alone while its stop vote was still in gloo's threads.

The fix no library makes for us: do every part of a normal exit that has an effect outside the process
(threading's shutdown, so non-daemon threads such as the checkpoint writer finish; the atexit handlers:
logging's flush, multiprocessing's end of loader workers; the flush of every open file), then os._exit.
Nothing that was written is lost, and no teardown runs in which a torch thread can abort the process.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import gc
import io
import os
import signal
import sys
import threading
import traceback
from typing import Callable, NoReturn


def exit_code_of(exc: SystemExit) -> int:
    """The status Python itself would exit with for ``raise SystemExit(code)`` (a message is printed, then 1)."""
    code = exc.code
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    print(code, file=sys.stderr)
    return 1


def run_and_exit(main: Callable[[], int | None]) -> NoReturn:
    """Run ``main`` as a program's entry point: its return value or SystemExit is the exit status, an
    uncaught exception is printed (through sys.excepthook, as Python would) and gives 1, and an uncaught
    KeyboardInterrupt ends the process by SIGINT, as Python 3.8+ does."""
    interrupted = False
    try:
        code = exit_code_of(SystemExit(main()))
    except SystemExit as exc:
        code = exit_code_of(exc)
    except KeyboardInterrupt:
        sys.excepthook(*sys.exc_info())
        code, interrupted = 130, True
    except BaseException:  # noqa: BLE001 - an entry point reports whatever escaped, as the interpreter would
        sys.excepthook(*sys.exc_info())
        code = 1
    exit_without_finalizing(code, by_sigint=interrupted)


# A flush that cannot finish (a daemon thread holds a stream's lock while blocked on a full pipe) must not keep a
# finished process alive: CPython's own finalization would fail fatally there instead.
EXIT_DEADLINE_S = 60.0


def exit_without_finalizing(code: int, by_sigint: bool = False) -> NoReturn:
    """Every stage runs whatever the previous one raised (a KeyboardInterrupt while the checkpoint writer is
    joined, a file object whose flush fails oddly); the process then ends with ``code`` in any case."""
    try:
        for stage in (_shutdown_threads, _arm_deadline(code), _run_atexit_handlers, _flush_open_files):
            try:
                stage()
            except BaseException:  # noqa: BLE001 - the exit status and the remaining stages come first
                with contextlib.suppress(BaseException):
                    traceback.print_exc()
        with contextlib.suppress(BaseException):
            _flush_c_streams()
        if by_sigint:
            signal.signal(signal.SIGINT, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGINT)
    finally:
        os._exit(code)


def _arm_deadline(code: int) -> Callable[[], None]:
    def arm() -> None:
        timer = threading.Timer(EXIT_DEADLINE_S, os._exit, args=(code,))
        timer.daemon = True
        timer.start()
    return arm


def _shutdown_threads() -> None:
    """What finalization does first: threading's own exit callbacks (concurrent.futures pools) and a join of
    every non-daemon thread. Private, but the same call the interpreter makes; joined by hand where absent."""
    shutdown = getattr(threading, "_shutdown", None)
    if shutdown is not None and threading.current_thread() is threading.main_thread():
        shutdown()
        return
    for thread in threading.enumerate():
        if thread is not threading.current_thread() and not thread.daemon:
            thread.join()


def _run_atexit_handlers() -> None:
    """Registered handlers, while the interpreter is whole. Each error is printed and the rest still run, as
    at a normal exit (atexit._run_exitfuncs does both).

    SIGCHLD goes back to its default first: torch's DataLoader installs a handler that raises when any of its
    workers has exited with an error, and multiprocessing's exit handler ends the daemon children (data.worker_start=
    fork: the loader's persistent workers are this process's children) with SIGTERM, which they answer with exit
    code 143: every other finished run printed "Exception ignored in atexit callback ... DataLoader worker exited
    unexpectedly with exit code 143". A worker's death at exit is the exit, not an error."""
    with contextlib.suppress(ValueError, OSError):  # not the main thread, or no SIGCHLD here
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    try:
        atexit._run_exitfuncs()  # noqa: SLF001 - the function the interpreter calls at exit
    except Exception:  # noqa: BLE001 - never lose the exit status to a handler
        traceback.print_exc()


def _flush_open_files() -> None:
    """Buffered data of files still open (a finalizing interpreter would close them): written, not dropped.
    Linear in the number of live objects (about 0.3 s per million)."""
    for obj in gc.get_objects():
        # type(obj), not isinstance: that reads obj.__class__, which some objects answer with a warning
        if issubclass(type(obj), io.IOBase):
            try:
                if not obj.closed and obj.writable():
                    obj.flush()
            except Exception:  # noqa: BLE001 - half-built or odd file objects: the others still get flushed
                pass
    for stream in (sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__):
        try:
            if stream is not None:
                stream.flush()
        except Exception:  # noqa: BLE001
            pass


def _flush_c_streams() -> None:
    """libc's stdio buffers, which os._exit does not flush: what C and C++ code printed with printf or fwrite and
    did not flush (NCCL_DEBUG lines into a Slurm log file, fully buffered there)."""
    ctypes.CDLL(None).fflush(None)
