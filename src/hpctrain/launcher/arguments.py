"""torchrun's arguments: those of a local launch, hpctrain's defaults, and the thread count they imply."""

from __future__ import annotations

import os
from typing import Sequence


def torchrun_args(nproc_per_node: int, module_args: Sequence[str]) -> list[str]:
    """torchrun's arguments for a local launch of ``python -m hpctrain MODULE_ARGS`` on ``nproc_per_node``."""
    return [
        "--standalone",  # c10d rendezvous on a free local port
        f"--nproc-per-node={nproc_per_node}",
        "-m", "hpctrain", *module_args,
    ]


def with_defaults(argv: Sequence[str], log_dir: str) -> list[str]:
    """``argv`` with hpctrain's defaults where the user gave none: torchrun handles SIGQUIT only (the other stop
    signals are the launcher's to forward), and its logs go to ``log_dir`` (removed after the launch)."""
    argv = list(argv)
    # torchrun registers its handlers (raise, shut the workers down) for the signals in this list when it
    # starts; the others stay ours. Its --signals-to-handle overrides TORCHELASTIC_SIGNALS_TO_HANDLE.
    if not any(a.startswith(("--signals-to-handle", "--signals_to_handle")) for a in argv):
        argv.insert(0, "--signals-to-handle=SIGQUIT")
    if not keeps_worker_logs(argv):
        # torchrun's default is a new /tmp/torchelastic_* folder per launch that nothing removes
        argv.insert(0, f"--log-dir={log_dir}")
    return argv


def keeps_worker_logs(argv: Sequence[str]) -> bool:
    """Whether torchrun is told where its logs go or to write the workers' output to files (flags or PET_*
    variables): then its log folder is the user's, not a temporary one."""
    own = list(argv[:argv.index("-m")] if "-m" in argv else argv)  # torchrun's, not the program's
    flags = ("--log-dir", "--log_dir", "--redirects", "-r", "--tee", "-t")
    given = any(a == f or a.startswith(f + "=") or (len(f) == 2 and a.startswith(f)) for a in own for f in flags)
    return given or any(os.environ.get(v) for v in ("PET_LOG_DIR", "PET_REDIRECTS", "PET_TEE"))


def worker_module(argv: Sequence[str]) -> tuple[str, list[str]] | None:
    """(module, its arguments) of torchrun's ``-m MODULE ARGS``, or None when the workers run a script."""
    at = next((i for i, a in enumerate(argv) if a in ("-m", "--module")), len(argv))  # torchrun's, the first
    return (argv[at + 1], list(argv[at + 2:])) if at + 1 < len(argv) else None


def oversubscription(nproc_per_node: int, environ: dict[str, str], cores: int) -> str | None:
    """One warning line when the workers' intra-op threads (OMP_NUM_THREADS each; torchrun sets 1 where it is
    unset for several workers) outnumber the cores this job may use (``cores``: os.sched_getaffinity), else None.
    Oversubscribed OpenMP threads wait for each other at every parallel op: 2 processes x 2 threads on 2 cores were
    reported about 5 times slower than with 1 thread each, without a word."""
    value = environ.get("OMP_NUM_THREADS", "")
    threads = int(value) if value.isdigit() and int(value) > 0 else 1
    if nproc_per_node * threads <= cores:
        return None
    fits = max(1, cores // nproc_per_node)
    return (f"hpctrain: {nproc_per_node} processes x OMP_NUM_THREADS={threads} = {nproc_per_node * threads} compute "
            f"threads on the {cores} core(s) this job may use: they will wait for each other at every op; set "
            f"OMP_NUM_THREADS={fits}" + ("" if nproc_per_node <= cores else " and fewer processes per node"))
