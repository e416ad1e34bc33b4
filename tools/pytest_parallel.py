"""Run groups of pytest arguments as concurrent pytest processes and report them as one run.

    python tools/pytest_parallel.py [--junit-prefix PATH] -- ARGS... [::: ARGS...]...

Each group (the arguments between ':::' separators) is one `python -m pytest -q -rA -p no:cacheprovider ARGS`
process, all started together, each writing its output live to PATH-<group>.log (with --junit-prefix; else a
temporary file); their outputs are printed one after the other once all have ended, then one line
"N passed, M failed, K skipped, E errors in S s (G groups)". The exit code is 0 when every group's is 0 or 5 (no test
collected in a group), else 1. SIGINT or SIGTERM to this process is passed on as one SIGINT to every group (pytest
then stops, prints what passed and failed so far and writes its junit xml), and the outputs are printed as usual.

Why: on a GPU node, tests/gpu spends most of its time compiling (Dynamo and Inductor, single-threaded per process)
while the GPU and 15 other cores idle. Running each compile test beside the rest cuts the wall time to about that of
the longest group within the quick check's 3-minute share; pytest-xdist would do the same but is not on GPU images.
"""

from __future__ import annotations

import argparse
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

COUNTS = ("passed", "failed", "skipped", "error", "errors", "xfailed", "xpassed")


def groups_of(args: list[str]) -> list[list[str]]:
    """['a', ':::', 'b', 'c'] -> [['a'], ['b', 'c']]; empty groups dropped."""
    out: list[list[str]] = [[]]
    for arg in args:
        if arg == ":::":
            out.append([])
        else:
            out[-1].append(arg)
    return [g for g in out if g]


def counts(output: str) -> dict[str, int]:
    """The counts of pytest's closing line ('3 passed, 1 failed, 2 skipped in 4.1s')."""
    lines = [line for line in output.splitlines() if re.search(r"\d+ (passed|failed|skipped|errors?)\b", line)]
    found: dict[str, int] = {}
    for number, word in re.findall(r"(\d+) (\w+)", lines[-1] if lines else ""):
        if word in COUNTS:
            key = "errors" if word in ("error", "errors") else word
            found[key] = found.get(key, 0) + int(number)
    return found


def summary(per_group: list[dict[str, int]], seconds: float) -> str:
    total = {k: sum(g.get(k, 0) for g in per_group) for k in ("passed", "failed", "skipped", "errors")}
    return (f"{total['passed']} passed, {total['failed']} failed, {total['skipped']} skipped, {total['errors']} errors "
            f"in {seconds:.1f} s ({len(per_group)} groups)")


def run(groups: list[list[str]], junit_prefix: str = "") -> int:
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="pytest-parallel-") as tmp:
        procs = []
        for i, group in enumerate(groups):
            log = open(f"{junit_prefix}-{i}.log" if junit_prefix else Path(tmp) / f"{i}.log", "w+")
            junit = [f"--junitxml={junit_prefix}-{i}.xml"] if junit_prefix else []
            cmd = [sys.executable, "-m", "pytest", "-q", "-rA", "-p", "no:cacheprovider", *junit, *group]
            # each in a session of its own: a signal to our process group reaches them once, through us
            procs.append((cmd, log, subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                                                     start_new_session=True)))

        def interrupt(_signum, _frame) -> None:
            for _, _, proc in procs:
                if proc.poll() is None:
                    proc.send_signal(signal.SIGINT)

        previous = {sig: signal.signal(sig, interrupt) for sig in (signal.SIGINT, signal.SIGTERM)}
        codes, per_group = [], []
        try:
            for cmd, log, proc in procs:
                codes.append(proc.wait())
                log.seek(0)
                output = log.read()
                log.close()
                print(f"==== group: {' '.join(cmd[3:])} (exit {codes[-1]})\n{output}", flush=True)
                per_group.append(counts(output))
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
    print(summary(per_group, time.perf_counter() - started), flush=True)
    return 0 if all(code in (0, 5) for code in codes) else 1


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--junit-prefix", default="", help="write PREFIX-<group>.xml per group")
    p.add_argument("rest", nargs=argparse.REMAINDER, help="-- ARGS [::: ARGS]...")
    args = p.parse_args(argv)
    rest = args.rest[1:] if args.rest[:1] == ["--"] else args.rest
    groups = groups_of(rest)
    if not groups:
        p.error("no pytest arguments: give -- ARGS [::: ARGS]...")
    return run(groups, args.junit_prefix)


if __name__ == "__main__":
    sys.exit(main())
