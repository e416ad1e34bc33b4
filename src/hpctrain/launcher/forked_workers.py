"""Workers started as forks of the launcher, which has imported torch and the workers' modules already.

torchrun starts each worker with Popen: a new Python that imports torch and the training loop again, most of a
short CPU run's start and of the test suite's time (BENCHMARKS.md). Where fork_safety allows it, the launcher imports
the workers' modules once and hands torchrun a subprocess handler whose process is a fork of the launcher, made to
look like the process torchrun's Popen would give: one pid per worker, directly under the launcher (so
PR_SET_PDEATHSIG and dist/parent_death.stop_with_launcher hold), a session of its own (torchrun signals the group),
the worker's environment, output files and argv, default signal handling, and none of the launcher's exit handlers.
The worker then runs its command's module (``python -u -m MODULE ARGS``) as ``__main__``, as the new Python would.

Torch's own Popen stays where a fork is not ours to make: another program or module (FORKED_MODULES), numactl
wrapping, or a fork refused. torch gives no hook for this: we replace its module-level handler factory for the
launch (checked to exist with parameters the replacement accepts, else torchrun's own is used and the launcher
says so).
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
import os
import runpy
import signal
import subprocess
import sys
import threading
import time
import warnings
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Sequence

from hpctrain.launcher.fork_safety import LauncherThreads, thread_refusal

FORKED_MODULES = frozenset({"hpctrain"})
"""The ``-m`` modules whose workers may be forks: hpctrain's own, whose start in a fork is tested (tests/dist); a
worker running another module starts as a new Python until its start in a fork is known to be safe."""


@dataclass(frozen=True)
class ModuleEntry:
    """A worker's ``python -m MODULE``: the module run as ``__main__`` (it reads sys.argv), then the exit a program
    that returns gets, without the interpreter's finalization (hpctrain.process_exit)."""

    module: str
    """The module torchrun's worker command names after ``-m``."""

    def __call__(self) -> None:
        from hpctrain.process_exit import exit_without_finalizing

        runpy.run_module(self.module, run_name="__main__", alter_sys=True)
        exit_without_finalizing(0)


@contextlib.contextmanager
def forked_workers(enabled: bool, preload: Sequence[str] = (),
                   threads: LauncherThreads | None = None) -> Iterator[bool]:
    """Within: torchrun's local workers (``python -u -m MODULE ...``, MODULE in FORKED_MODULES) are forks of this
    process that run MODULE as ``__main__`` (ModuleEntry) after importing the modules ``preload`` names here, once
    for all of them; ``threads``: quiet_launcher's record, checked after those imports (None: not checked).
    Entered right before torchrun starts, and before the launcher starts threads of its own (the node monitors').
    Yields whether the fork path is in place."""
    api = torch_subprocess_api() if enabled else None
    if api is None:
        if enabled:
            print("hpctrain: this torch's torchrun has no subprocess handler factory with the parameters hpctrain's "
                  "replacement accepts; its workers start as new Pythons", file=sys.stderr)
        yield False
        return
    present = set(threading.enumerate())
    for name in preload:
        importlib.import_module(name)
    ours = frozenset(t for t in threading.enumerate() if t not in present)  # torch's and hpctrain's imports'
    refusal = thread_refusal(threads, ours) if threads is not None else None
    if refusal:
        print(f"hpctrain: the workers start as new Pythons, not as forks of the launcher: {refusal}", file=sys.stderr)
        yield False
        return
    intra_op = threads.intra_op if threads is not None else 0
    original = api.get_subprocess_handler

    def handler(*, entrypoint: str, args: tuple, env: dict[str, str], stdout: Any, stderr: Any,
                local_rank_id: int, numa_options: Any = None) -> Any:
        kwargs = dict(entrypoint=entrypoint, args=args, env=env, stdout=stdout, stderr=stderr,
                      local_rank_id=local_rank_id, numa_options=numa_options)
        command = module_command(entrypoint, args)
        if numa_options is None and command is not None:
            try:
                return _forked_handler_class(ModuleEntry(command[0]), intra_op)(**kwargs)
            except OSError as err:  # fork refused (strict overcommit, process limit): Popen may still work
                print(f"hpctrain: could not fork a worker ({err}); starting it as a new Python", file=sys.stderr)
        return original(**kwargs)

    api.get_subprocess_handler = handler
    try:
        yield True
    finally:
        api.get_subprocess_handler = original


def module_command(entrypoint: str, args: tuple) -> tuple[str, list[str]] | None:
    """(MODULE, its arguments) when torchrun's command is this Python running ``-u -m MODULE`` of FORKED_MODULES,
    else None."""
    head = [str(a) for a in args[:3]]
    # abspath, not realpath: two venvs' pythons are links to one binary, with other site-packages (PYTHON_EXEC)
    if os.path.abspath(entrypoint) != os.path.abspath(sys.executable) or head[:2] != ["-u", "-m"] or len(head) < 3:
        return None
    return (head[2], [str(a) for a in args[3:]]) if head[2] in FORKED_MODULES else None


HANDLER_PARAMETERS = ("entrypoint", "args", "env", "stdout", "stderr", "local_rank_id", "numa_options")
"""The keywords forked_workers' handler accepts: those of get_subprocess_handler in torch 2.11 to 2.14."""


def torch_subprocess_api():
    """torch's elastic multiprocessing module when it has the factory this replaces, with no parameter the
    replacement does not accept (a keyword a later torch adds would be a TypeError at every launch), else None."""
    try:
        from torch.distributed.elastic.multiprocessing import api
        from torch.distributed.elastic.multiprocessing.subprocess_handler import SubprocessHandler
    except ImportError:
        return None
    factory = getattr(api, "get_subprocess_handler", None)
    if not callable(factory) or not hasattr(SubprocessHandler, "_popen"):
        return None
    try:
        parameters = inspect.signature(factory).parameters
    except (TypeError, ValueError):
        return None
    if set(parameters) - set(HANDLER_PARAMETERS) or not set(HANDLER_PARAMETERS[:-1]) <= set(parameters):
        return None
    return api


def _forked_handler_class(entry: Callable[[], Any], intra_op: int = 0):
    from torch.distributed.elastic.multiprocessing.subprocess_handler import SubprocessHandler

    class ForkedHandler(SubprocessHandler):
        """torch's handler, with a fork of the launcher in place of its Popen (it opened the output files)."""

        def _popen(self, args: tuple, env: dict[str, str]) -> "ForkedProcess":
            command = module_command(args[0], tuple(args[1:]))
            assert command is not None  # checked by forked_workers' handler
            process = ForkedProcess.start(command[1], env, getattr(self, "_stdout", None),
                                          getattr(self, "_stderr", None), entry, intra_op)
            process.args = [str(a) for a in args]  # the command torchrun gave, as Popen's args would be
            return process

    return ForkedHandler


class ForkedProcess:
    """What torchrun uses of a Popen (pid, returncode, poll, wait, send_signal, terminate, kill) for a forked
    worker. Its exit status is collected by waitpid here, as Popen does for its own."""

    def __init__(self, pid: int, args: list[str]) -> None:
        self.pid = pid
        self.args = args  # for messages: torchrun's command when its handler started the worker
        self.returncode: int | None = None

    @classmethod
    def start(cls, module_args: list[str], env: dict[str, str], stdout: Any, stderr: Any,
              entry: Callable[[], Any], intra_op: int = 0) -> "ForkedProcess":
        """``intra_op``: torch's intra-op threads for a worker whose environment has no OMP_NUM_THREADS (0: leave
        them as the launcher has them)."""
        _flush_everything()  # nothing buffered here may be written twice
        # Signals stay blocked from before the fork until the child has its own session and default handlers: a
        # signal the launcher forwards (it finds the new pid in /proc at once) must not run the launcher's handlers
        # in the child, and torchrun's killpg(pid) needs the child's group to exist when start() returns (Popen
        # returns after the exec). The child closes ``ready`` when it is there.
        ready_r, ready_w = os.pipe()
        filters = list(warnings.filters)
        pid, mask = -1, None
        try:
            mask = signal.pthread_sigmask(signal.SIG_BLOCK, signal.valid_signals())
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", DeprecationWarning)  # 3.12+: "multi-threaded, use of fork()"
                pid = os.fork()
                if pid == 0:
                    _child(module_args, env, (stdout, stderr), entry, ready_r, ready_w, filters, intra_op)  # no return
            os.close(ready_w)
            ready_w = -1
            # restoring the mask runs a pending handler, which may raise (torchrun's SIGQUIT): handled below
            signal.pthread_sigmask(signal.SIG_SETMASK, mask)
            mask = None
            os.read(ready_r, 1)  # b"" when the child closed it (or died before)
        except BaseException:
            if pid > 0:  # torchrun will never hear of this child: it must not live on
                with contextlib.suppress(OSError):
                    os.kill(pid, signal.SIGKILL)
                    os.waitpid(pid, 0)
            raise
        finally:
            if mask is not None:
                signal.pthread_sigmask(signal.SIG_SETMASK, mask)
            for fd in (ready_r, ready_w):
                if fd >= 0:
                    os.close(fd)
        return cls(pid, list(module_args))

    def poll(self) -> int | None:
        if self.returncode is None:
            try:
                pid, status = os.waitpid(self.pid, os.WNOHANG)
            except ChildProcessError:  # reaped by someone else: its status is gone
                self.returncode = 255
                return self.returncode
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        return wait_by_polling(self, timeout)

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def wait_by_polling(process: Any, timeout: float | None = None) -> int:
    """Popen.wait for a process object whose poll() says when it has ended (a fork, a held worker): raises
    subprocess.TimeoutExpired after ``timeout`` seconds, as Popen's does."""
    deadline = None if timeout is None else time.monotonic() + timeout
    delay = 0.001
    while (code := process.poll()) is None:
        if deadline is not None and time.monotonic() >= deadline:
            raise subprocess.TimeoutExpired(process.args, timeout)
        time.sleep(delay)
        delay = min(delay * 2, 0.05)
    return code


def _child(module_args: list[str], env: dict[str, str], output: tuple[Any, Any], entry: Callable[[], Any],
           ready_r: int, ready_w: int, filters: list, intra_op: int) -> None:
    """The forked child's first steps; whatever happens, it ends in _become_worker's os._exit."""
    try:
        os.close(ready_r)
        warnings.filters[:] = filters
    finally:
        _become_worker(module_args, env, output, entry, ready_w, intra_op)


def _become_worker(module_args: list[str], env: dict[str, str], output: tuple[Any, Any],
                   entry: Callable[[], Any], ready: int, intra_op: int) -> None:
    """In the forked child (every signal blocked): the state a new `python -u -m MODULE MODULE_ARGS` would start
    with, then ``entry`` (the module, and its exit). Never returns into the launcher's code, whatever happens."""
    code = 1
    try:
        os.setsid()  # what torchrun's Popen(start_new_session=True) gives: it signals the worker's group
        _default_signals()
        os.close(ready)  # the launcher's start() returns: our group exists, its handlers are gone
        signal.pthread_sigmask(signal.SIG_SETMASK, [])  # a signal sent meanwhile is delivered now, to us
        for stream, fd in zip(output, (1, 2)):
            if stream is not None:
                os.dup2(stream.fileno(), fd)
        _close_launcher_fds()
        os.environ.clear()
        os.environ.update(env)
        _forget_launcher_state()
        sys.argv = ["-m", *module_args]  # as python -m has it until it finds the module (runpy: its file)
        _threads_from_environment(intra_op)
        for stream in (sys.stdout, sys.stderr):  # python -u
            with contextlib.suppress(Exception):
                stream.reconfigure(write_through=True)
        entry()  # ends the process (ModuleEntry: the module's own exit, or process_exit's)
    except SystemExit as exc:
        from hpctrain.process_exit import exit_code_of

        code = exit_code_of(exc)
    except KeyboardInterrupt:  # Ctrl-C before main() took over: an interrupt, as the launcher counts them
        code = 130
    except BaseException:  # noqa: BLE001 - a new Python would print it and exit 1
        import traceback

        traceback.print_exc()
    finally:
        # no signal may raise here and unwind into the launcher's code (torchrun's loop, torchrun.main's clean-up)
        try:
            with contextlib.suppress(BaseException):
                signal.pthread_sigmask(signal.SIG_BLOCK, signal.valid_signals())
            with contextlib.suppress(BaseException):
                sys.stdout.flush()
                sys.stderr.flush()
        finally:
            os._exit(code)


def _flush_everything() -> None:
    """Python's and C's output buffers, and the launcher's objects: a fork copies them all, and a worker that
    flushed or collected them would write the launcher's output again or finalise the launcher's garbage. gc.freeze
    (Python's advice before a fork, and cheaper than a collection: 0.3 s here) puts every object alive now out of the
    collector's reach, in the launcher and its workers alike."""
    import ctypes
    import gc

    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None).fflush(None)
    gc.freeze()


def _default_signals() -> None:
    """A new Python's signal handling: the launcher's handlers (forwarding, torchrun's, any --signals-to-handle) are
    not the worker's. Python ignores SIGPIPE and SIGXFSZ at start-up, as the launcher did: those stay."""
    for sig in signal.valid_signals():
        with contextlib.suppress(OSError, ValueError, TypeError):
            if callable(signal.getsignal(sig)):
                signal.signal(sig, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)


def _forget_launcher_state() -> None:
    """Exit handlers and child lists that belong to the launcher. Those a module registered when it was imported
    (logging's flush, multiprocessing's end of its children, torch's loader flag) stay: a new Python importing the
    same modules registers them too. The launcher's own finalizers (weakref.finalize with atexit) and its
    multiprocessing children and finalizers are the launcher's to run, not the worker's."""
    import multiprocessing.process
    import multiprocessing.util

    for info in list(weakref.finalize._registry.values()):  # type: ignore[attr-defined]
        info.atexit = False
    multiprocessing.process._children.clear()  # type: ignore[attr-defined]
    multiprocessing.util._finalizer_registry.clear()  # type: ignore[attr-defined]
    multiprocessing.util._run_after_forkers()  # type: ignore[attr-defined]
    _forget_helper_processes()
    from hpctrain import logs

    logs.forget_recent_lines()


def _forget_helper_processes() -> None:
    """The launcher's resource tracker and forkserver, if it started them: their fds are closed here
    (_close_launcher_fds), and a write to one of those numbers could reach a file the worker opened since. The
    worker starts its own, as a new Python would."""
    from multiprocessing import forkserver, resource_tracker

    tracker = resource_tracker._resource_tracker  # type: ignore[attr-defined]
    tracker._fd, tracker._pid = None, None
    server = forkserver._forkserver  # type: ignore[attr-defined]
    server._forkserver_address = server._forkserver_alive_fd = server._forkserver_pid = None


def _threads_from_environment(intra_op: int) -> None:
    """torch's intra-op threads as OMP_NUM_THREADS says (torchrun sets 1 for several workers): OpenMP read the
    variable when the launcher loaded it, before torchrun set it. Without it, ``intra_op`` (the launcher's count
    before quiet_launcher set one; 0: keep the launcher's)."""
    value = os.environ.get("OMP_NUM_THREADS", "")
    threads = int(value) if value.isdigit() and int(value) > 0 else intra_op
    if threads:
        import torch

        torch.set_num_threads(threads)


def _close_launcher_fds() -> None:
    """What exec would do (Python opens its fds close-on-exec): the worker keeps 0, 1 and 2, nothing of the
    launcher's: its store's listening sockets and connections, libuv's epoll and io_uring instances, the monitors'
    pipes. A worker that outlives a SIGKILLed launcher must not hold the rendezvous ports open. The launcher's
    objects that own those fds are never finalised here (gc.freeze before the fork; the worker never returns into
    the frames that hold them), so no close of a number the worker reuses comes later."""
    os.closerange(3, _max_fd())


def _max_fd() -> int:
    try:
        return max(int(fd) for fd in os.listdir("/proc/self/fd")) + 1
    except (OSError, ValueError):  # no procfs
        return os.sysconf("SC_OPEN_MAX")
