"""Local multi-process launch through torchrun (torch.distributed.run), not a spawner of our own.

torchrun runs in its own session so that a Ctrl-C reaches it once, through us,
rather than twice (from the terminal and from us); PR_SET_PDEATHSIG makes it
receive SIGTERM if we die, so no orphaned workers survive their launcher.
"""

from __future__ import annotations

import ctypes
import signal
import subprocess
import sys
from typing import Sequence

FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2)
_PR_SET_PDEATHSIG = 1


def torchrun_command(nproc_per_node: int, module_args: Sequence[str]) -> list[str]:
    # torch.distributed.run's own main, wrapped only to shorten its failure report.
    return [
        sys.executable, "-m", "hpctrain.launch",
        "--standalone",  # c10d rendezvous on a free local port
        f"--nproc-per-node={nproc_per_node}",
        "-m", "hpctrain", *module_args,
    ]


def die_with_parent() -> None:  # runs in the child between fork and exec
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    except OSError:  # pragma: no cover - not glibc Linux
        pass


def run_forwarding_signals(cmd: Sequence[str]) -> int:
    """Run ``cmd``; forward our signals to it; return its exit code (128+N if killed by signal N)."""
    proc = subprocess.Popen(list(cmd), start_new_session=True, preexec_fn=die_with_parent)

    def forward(signum, _frame) -> None:
        if proc.poll() is None:
            proc.send_signal(signum)

    previous = {sig: signal.signal(sig, forward) for sig in FORWARDED}
    try:
        code = proc.wait()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return 128 - code if code < 0 else code
