"""Whether the workers may be forks of the launcher, and the launcher's threads that decide it.

Not with a CUDA device visible (CUDA's state cannot cross a fork) or HPCTRAIN_WORKER_START=exec. Nor with threads
that a fork would inherit half. torch's CPU build uses GNU OpenMP, which is not fork-safe: a fork inherits the
parent's thread team as bookkeeping without the threads, and its first parallel op waits for them forever; the
launcher imports the user's experiment module (a module-level tensor op starts that team when OMP_NUM_THREADS > 1).
So the launcher runs on one intra-op thread from before it imports user code (quiet_launcher), and right before the
launch thread_refusal checks that nothing since has started native threads or raised the thread count, that code
run before (a sitecustomize or .pth plugin) left no more native threads than numpy's OpenBLAS server keeps (which
stops itself around a fork), and that no Python thread hpctrain and torch did not start runs (a lock it holds at
the fork stays held in every worker). Those torchrun and the node monitors start during the launch are its own.
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass

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

