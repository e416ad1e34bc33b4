"""Fault-tolerance timings for the digits demo (2 processes, torchrun, gloo on CPU). Prints a table.

    python benchmarks/fault.py [--repeats 5]

- stop after signal: SIGTERM to ONE rank (its whole process group, as Slurm does) while training;
  seconds until every rank has saved and the launcher has exited with 75.
- checkpoint: size and save time of the demo's checkpoint (from the 'saved checkpoint' log lines).
- crash to exit: SIGKILL to one rank; seconds until the launcher has exited, naming the rank.
- stop at an eval step: a wider model (model.width=96, a ~60 MB checkpoint with AdamW), SIGTERM to rank 0
  inside step 39, so the stop is agreed at step 40, where validation is due (eval.every_steps=20) and the
  background write of step 39's checkpoint (ckpt.every_steps=39) may still be running. Seconds from the
  signal to the checkpoint on disk, as rank 0 logs them; and, from a run without the signal, how long the
  validation at step 40 takes (what the stop would cost if it validated first, as hpctrain did before).
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


EVAL_STOP = ["train", "digits", "--nproc-per-node", "2", "model.width=96", "train.max_steps=60", "eval.every_steps=20",
             "ckpt.every_steps=39", "log.every_steps=1", "log.plots=false", "log.tensorboard=false"]


def eval_stop_run(signal_it: bool) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        run_dir = Path(tmp) / "run"
        env = {**os.environ, **({"HPCTRAIN_FAULT": "signal:rank=0:step=38"} if signal_it else {})}
        done = subprocess.run([sys.executable, "-m", "hpctrain", *EVAL_STOP, f"run.dir={run_dir}"], env=env,
                              capture_output=True, text=True, timeout=600)
        output = done.stdout + done.stderr
        after = re.search(r"stopped by SIGTERM at step 40 with a checkpoint, ([\d.]+) s after the signal", output)
        records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        at_40 = {r["split"]: r["time"] for r in records if r["step"] == 40}
        return {"code": done.returncode, "signal_to_saved_s": float(after.group(1)) if after else None,
                "eval_s": at_40["val"] - at_40["train"] if "val" in at_40 else None,
                "saves": [float(mb) for mb in re.findall(r"saved checkpoint .* \(([\d.]+) MB[ ;]", output)]}


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
    stopped = [eval_stop_run(True) for _ in range(args.repeats)]
    straight = [eval_stop_run(False) for _ in range(args.repeats)]
    assert all(r["code"] == 75 and r["signal_to_saved_s"] is not None for r in stopped), stopped
    assert all(r["code"] == 0 and r["eval_s"] is not None for r in straight), straight
    saves = [s for r in stops for s in r["saves"]]
    print(f"digits demo, 2 processes (torchrun, gloo/CPU), {args.repeats} runs each, median [min, max]")
    print("| measure | value |")
    print("|---|---|")
    print(f"| SIGTERM to one rank -> all ranks saved, launcher exited 75 | {fmt([r['seconds'] for r in stops], 's')} |")
    print(f"| checkpoint size | {fmt([mb for mb, _ in saves], 'MB')} |")
    print(f"| checkpoint save time (rank 0 write, fsync, rename) | {fmt([s * 1000 for _, s in saves], 'ms')} |")
    print(f"| SIGKILL of one rank -> launcher exited 137, rank named | {fmt([r['seconds'] for r in crashes], 's')} |")
    print(f"| stop at an eval step, background write in flight ({stopped[0]['saves'][-1]:.0f} MB): "
          f"signal -> checkpoint on disk | {fmt([r['signal_to_saved_s'] for r in stopped], 's')} |")
    print(f"| the validation at that step, skipped by the stop (measured without a signal) | "
          f"{fmt([r['eval_s'] for r in straight], 's')} |")


if __name__ == "__main__":
    main()
