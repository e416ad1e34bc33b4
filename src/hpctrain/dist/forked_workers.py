"""Workers started as forks of the launcher, which has imported torch and hpctrain already, on machines without CUDA.

torchrun starts each worker with Popen: a new Python that imports torch and torch.distributed.checkpoint again,
about 3.7 s of CPU per worker on the project's 2-core VM (BENCHMARKS.md), most of a short CPU run's start and most
of the test suite's time. Where no CUDA device is visible, hpctrain's launcher imports the worker's modules once
and hands torchrun a subprocess handler whose process is a fork of the launcher, made to look like the process
torchrun's Popen would give: one pid per worker, directly under the launcher (so PR_SET_PDEATHSIG and
dist/launcher.stop_with_launcher hold), a session of its own (torchrun signals the group), the worker's
environment, output files and argv, default signal handling, and none of the launcher's exit handlers. The worker
then runs `python -m hpctrain ...` in-process (the entry point the launcher passes: cli.entry_point), as the new
Python would have.

Torch's own Popen stays where a fork would be unsafe or is not ours to make: with a CUDA device visible (CUDA's
state cannot cross a fork, and the launcher may have touched it), a command that is not `python -u -m hpctrain`
(numactl wrapping, another program), HPCTRAIN_WORKER_START=exec, or threads in the launcher that a fork would
inherit half (below). torch gives no hook for this: we replace its module-level handler factory for the launch
(checked to exist with parameters the replacement accepts, else torchrun's own is used and the launcher says so).

OpenMP. torch's CPU build uses GNU OpenMP, which is not fork-safe: a fork inherits the parent's thread team as
bookkeeping without the threads, and its first parallel op waits for them forever. The launcher imports the user's
experiment module (to check the config) before it forks, and a module-level op such as ``(torch.randn(N) * 2).sum()``
starts that team whenever OMP_NUM_THREADS > 1. So the launcher runs on one intra-op thread from before it imports
user code (quiet_launcher: no team is ever started, the import's own ops run serially), each worker sets its threads
as a new Python would, and right before the launch the launcher checks that nothing since has started native threads
or raised its thread count (user code calling torch.set_num_threads, a library's own pool): then every worker starts
as a new Python and the launcher says why, once. The same where code that ran before quiet_launcher (a sitecustomize
or .pth plugin) left more native threads than numpy's OpenBLAS server keeps (which stops itself around a fork: its
pthread_atfork handler, checked here): an OpenMP team may be among them. And the same for a Python thread that
hpctrain and torch did not start (a plugin's, or one the experiment's module started at its import): a lock it holds
at the fork stays held in every worker. Those torchrun starts during the launch (its store's, its rendezvous
keep-alive) and the node monitors' are the launcher's own.
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
import os
import signal
import subprocess
import sys
import threading
import time
import warnings
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Sequence

WORKER_START_ENV = "HPCTRAIN_WORKER_START"
"""auto (default): forked where no CUDA device is visible; exec: every worker a new Python (torchrun's Popen)."""

def fork_refusal(environ: dict[str, str] | None = None) -> str | None:
    """Why this launch's workers must be new Pythons, or None when they can be forks of the launcher."""
    setting = (environ if environ is not None else os.environ).get(WORKER_START_ENV, "auto").strip().lower()
    if setting == "exec":
        return f"{WORKER_START_ENV}=exec"
    if setting not in ("auto", ""):
        return f"{WORKER_START_ENV}={setting!r} is not auto or exec"
    import torch

    if torch.cuda.is_available():
        return "a CUDA device is visible (CUDA's state cannot cross a fork)"
    return None


@dataclass(frozen=True)
class LauncherThreads:
    """The launcher's threads from before it imported the experiment's module (quiet_launcher)."""

    native: frozenset[int]
    """Ids of the threads then that Python's threading does not know (numpy's OpenBLAS server, for one)."""
    intra_op: int
    """torch's intra-op threads then: what a worker without OMP_NUM_THREADS gets, as a new Python would."""
    unexplained: int = 0
    """How many of ``native`` numpy's OpenBLAS server does not account for: an OpenMP team that code run before
    (a sitecustomize or .pth plugin, a tensor op) started may be among them, and a fork would inherit it."""
    python: frozenset[threading.Thread] = frozenset()
    """Python threads then besides the main one (a plugin's): not hpctrain's or torchrun's."""


def quiet_launcher() -> LauncherThreads:
    """Before the launcher imports user code: torch's intra-op threads set to one, so that parallel work at the
    import of the user's module starts no OpenMP team for the workers to inherit (module docstring)."""
    import torch

    native = native_threads()
    before = LauncherThreads(native, torch.get_num_threads(), max(0, len(native) - openblas_server_threads()),
                             frozenset(python_threads()))
    torch.set_num_threads(1)
    return before


def python_threads() -> list[threading.Thread]:
    """This process's Python threads but the main one."""
    return [t for t in threading.enumerate() if t is not threading.main_thread()]


def openblas_server_threads() -> int:
    """The threads the OpenBLAS libraries loaded here (numpy's) start when they load: a pthreads build keeps one
    fewer than its thread count waiting (none with OMP_NUM_THREADS=1 or one core), and stops them around a fork
    (its pthread_atfork handler); an OpenMP or serial build keeps none. What a plain ``import torch`` leaves."""
    import ctypes

    total = 0
    for path in _loaded_libraries("openblas"):
        try:
            lib = ctypes.CDLL(path, mode=os.RTLD_NOLOAD | os.RTLD_LAZY)
        except OSError:
            continue
        names = [f"{prefix}openblas_get_%s{suffix}" for prefix in ("", "scipy_") for suffix in ("", "64_")]
        count = next((f() for f in (getattr(lib, n % "num_threads", None) for n in names) if f is not None), 1)
        parallel = next((f() for f in (getattr(lib, n % "parallel", None) for n in names) if f is not None), 1)
        total += max(0, count - 1) if parallel == 1 else 0
    return total


def _loaded_libraries(name: str) -> set[str]:
    """Paths of the shared libraries mapped into this process whose file name holds ``name``."""
    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split(maxsplit=5)[-1].strip() for line in maps if "/" in line}
    except OSError:  # pragma: no cover - no procfs
        return set()
    return {p for p in paths if name in os.path.basename(p).lower() and ".so" in os.path.basename(p)}


def native_threads() -> frozenset[int]:
    """Ids of this process's threads that Python's threading module does not know (OpenMP's, OpenBLAS's, libuv's)."""
    try:
        tasks = {int(t) for t in os.listdir("/proc/self/task")}
    except OSError:  # pragma: no cover - no procfs: nothing is known, so nothing is counted as new
        return frozenset()
    return frozenset(tasks - {t.native_id for t in threading.enumerate()})


OPENMP_HANG = "a fork could inherit an OpenMP team without its threads and hang at its first parallel op"


def thread_refusal(before: LauncherThreads, ours: frozenset[threading.Thread] = frozenset()) -> str | None:
    """Why a fork of the launcher is unsafe now, or None: threads that user code (or code before hpctrain) started,
    which a fork would inherit half. ``ours``: Python threads that hpctrain's own imports started (torch's, for the
    workers' modules). Called right before torchrun starts: from then on only torchrun's and hpctrain's code runs
    in the launcher, so the threads a fork meets beyond these are theirs (torchrun's rendezvous keep-alive, the
    node monitors' readers)."""
    import torch

    if torch.get_num_threads() != 1:
        return (f"code the launcher ran set torch's intra-op threads to {torch.get_num_threads()} "
                f"(torch.set_num_threads at the import of the experiment's module?): {OPENMP_HANG}")
    if before.unexplained:
        return (f"{before.unexplained} native thread(s) more than numpy's OpenBLAS keeps were running before the "
                f"launcher imported the experiment's module (an OpenMP team a sitecustomize or .pth plugin started?): "
                f"{OPENMP_HANG}")
    started = native_threads() - before.native
    if started:
        return (f"{len(started)} native thread(s) started in the launcher since it imported the experiment's module "
                f"(an OpenMP team or another library's thread pool): {OPENMP_HANG}")
    others = [t for t in python_threads() if t not in ours]
    if others:
        names = ", ".join(sorted(repr(t.name) for t in others))
        when = ("were running before the launcher imported the experiment's module (a sitecustomize or .pth "
                "plugin's?)" if all(t in before.python for t in others) else
                "started at the import of the experiment's module or before")
        return (f"Python thread(s) {names} {when}: a lock one of them holds at the fork stays held in every worker, "
                "which then hangs on it")
    return None


@contextlib.contextmanager
def forked_workers(enabled: bool, entry: Callable[[], Any], preimport: Sequence[str] = (),
                   threads: LauncherThreads | None = None) -> Iterator[bool]:
    """Within: torchrun's local workers (``python -u -m hpctrain ...``) are forks of this process that call
    ``entry`` (what ``python -m hpctrain`` runs; it reads sys.argv and ends the process) after importing the modules
    ``preimport`` names here, once for all of them; ``threads``: quiet_launcher's record, checked after those imports
    (None: not checked). Entered right before torchrun starts, and before the launcher starts threads of its own
    (the node monitors'). Yields whether the fork path is in place."""
    api = _torch_api() if enabled else None
    if api is None:
        if enabled:
            print("hpctrain: this torch's torchrun has no subprocess handler factory with the parameters hpctrain's "
                  "replacement accepts; its workers start as new Pythons", file=sys.stderr)
        yield False
        return
    present = set(threading.enumerate())
    for name in preimport:
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
        if numa_options is None and hpctrain_module_args(entrypoint, args) is not None:
            try:
                return _forked_handler_class(entry, intra_op)(**kwargs)
            except OSError as err:  # fork refused (strict overcommit, process limit): Popen may still work
                print(f"hpctrain: could not fork a worker ({err}); starting it as a new Python", file=sys.stderr)
        return original(**kwargs)

    api.get_subprocess_handler = handler
    try:
        yield True
    finally:
        api.get_subprocess_handler = original


def hpctrain_module_args(entrypoint: str, args: tuple) -> list[str] | None:
    """The arguments after ``-m hpctrain`` when torchrun's command is this Python running hpctrain, else None."""
    head = [str(a) for a in args[:3]]
    # abspath, not realpath: two venvs' pythons are links to one binary, with other site-packages (PYTHON_EXEC)
    if os.path.abspath(entrypoint) != os.path.abspath(sys.executable) or head != ["-u", "-m", "hpctrain"]:
        return None
    return [str(a) for a in args[3:]]


HANDLER_PARAMETERS = ("entrypoint", "args", "env", "stdout", "stderr", "local_rank_id", "numa_options")
"""The keywords forked_workers' handler accepts: those of get_subprocess_handler in torch 2.11 to 2.14."""


def _torch_api():
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
            module_args = hpctrain_module_args(args[0], tuple(args[1:]))
            assert module_args is not None  # checked by forked_workers' handler
            return ForkedProcess.start(module_args, env, getattr(self, "_stdout", None), getattr(self, "_stderr", None),
                                       entry, intra_op)

    return ForkedHandler


class ForkedProcess:
    """What torchrun uses of a Popen (pid, returncode, poll, wait, send_signal, terminate, kill) for a forked
    worker. Its exit status is collected by waitpid here, as Popen does for its own."""

    def __init__(self, pid: int, args: list[str]) -> None:
        self.pid = pid
        self.args = args
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
        return cls(pid, ["python", "-u", "-m", "hpctrain", *module_args])

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
        deadline = None if timeout is None else time.monotonic() + timeout
        delay = 0.001
        while self.poll() is None:
            if deadline is not None and time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired(self.args, timeout)
            time.sleep(delay)
            delay = min(delay * 2, 0.05)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


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
    """In the forked child (every signal blocked): the state a new `python -u -m hpctrain MODULE_ARGS` would start
    its main() with, then main() and hpctrain's own exit. Never returns into the launcher's code, whatever happens."""
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
        import hpctrain

        sys.argv = [os.path.join(os.path.dirname(hpctrain.__file__), "__main__.py"), *module_args]
        _threads_from_environment(intra_op)
        for stream in (sys.stdout, sys.stderr):  # python -u
            with contextlib.suppress(Exception):
                stream.reconfigure(write_through=True)
        entry()  # ends the process (cli.entry_point: process_exit.run_and_exit)
    except SystemExit as exc:
        from hpctrain.process_exit import exit_code_of

        code = exit_code_of(exc)
    except KeyboardInterrupt:  # Ctrl-C before main() took over: an interrupt, as the launcher counts them
        code = 130
    except BaseException:  # noqa: BLE001 - a new Python would print it and exit 1
        import traceback

        traceback.print_exc()
    finally:
        # no signal may raise here and unwind into the launcher's code (torchrun's loop, launch.main's clean-up)
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
