"""Fault-tolerance timings for the digits demo (2 processes, torchrun, gloo on CPU). Prints a table.

    python benchmarks/fault.py [--repeats 5]

- stop after signal: SIGTERM to ONE rank (its whole process group, as Slurm does) while training;
  seconds until every rank has saved and the launcher has exited with 75.
- checkpoint: size and save time of the demo's checkpoint (from the 'saved checkpoint' log lines).
- crash to exit: SIGKILL to one rank; seconds until the launcher has exited, naming the rank.
Median [min, max] over the repeats. These are wall-clock times on a shared machine: read them as
orders of magnitude, not as exact figures.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

DEMO = ["train", "digits", "--nproc-per-node", "2", "train.epochs=200", "log.plots=false", "log.tensorboard=false",
        "fault.heartbeat_every_s=0.5"]


def start(run_dir: Path) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "hpctrain", *DEMO, f"run.dir={run_dir}"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)


def rank_pid(run_dir: Path, rank: int, deadline_s: float = 120) -> int:
    end = time.monotonic() + deadline_s
    beat = run_dir / "heartbeat" / f"rank_{rank}.json"
    while time.monotonic() < end:
        try:
            data = json.loads(beat.read_text())
            if data["step"] >= 20:  # well into training, past warm-up
                return int(data["pid"])
        except (OSError, ValueError, KeyError):
            pass
        time.sleep(0.1)
    raise TimeoutError("training did not start")


def one_run(sig: signal.Signals) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        run_dir = Path(tmp) / "run"
        proc = start(run_dir)
        try:
            pid = rank_pid(run_dir, 1)
            sent = time.monotonic()
            os.killpg(pid, sig)
            code = proc.wait(timeout=120)
            seconds = time.monotonic() - sent
            output = proc.stdout.read()
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
        saves = [(float(mb), float(ms) / 1000) for mb, ms in re.findall(r"saved checkpoint .* \(([\d.]+) MB in ([\d.]+) ms\)", output)]
        return {"seconds": seconds, "code": code, "saves": saves, "named": "worker rank 1" in output}


def fmt(values: list[float], unit: str) -> str:
    return f"{statistics.median(values):.2f} {unit} [{min(values):.2f}, {max(values):.2f}]"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    stops = [one_run(signal.SIGTERM) for _ in range(args.repeats)]
    crashes = [one_run(signal.SIGKILL) for _ in range(args.repeats)]
    assert all(r["code"] == 75 for r in stops), [r["code"] for r in stops]
    assert all(r["code"] == 137 and r["named"] for r in crashes), [r["code"] for r in crashes]
    saves = [s for r in stops for s in r["saves"]]
    print(f"digits demo, 2 processes (torchrun, gloo/CPU), {args.repeats} runs each, median [min, max]")
    print("| measure | value |")
    print("|---|---|")
    print(f"| SIGTERM to one rank -> all ranks saved, launcher exited 75 | {fmt([r['seconds'] for r in stops], 's')} |")
    print(f"| checkpoint size | {fmt([mb for mb, _ in saves], 'MB')} |")
    print(f"| checkpoint save time (rank 0 write, fsync, rename) | {fmt([s * 1000 for _, s in saves], 'ms')} |")
    print(f"| SIGKILL of one rank -> launcher exited 137, rank named | {fmt([r['seconds'] for r in crashes], 's')} |")


if __name__ == "__main__":
    main()
