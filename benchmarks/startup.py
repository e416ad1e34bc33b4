"""Time from process start to the first optimizer step, and to the end of a one-step run. Prints a table.

    python benchmarks/startup.py [--repeats 5] [--before OLD_CHECKOUT/src]

For the digits demo (gloo on CPU): a fresh start and a resume from a checkpoint, on 1 process and on 2
(torchrun). "first step" is the wall-clock time of the first train record (log.every_steps=1) in
metrics.jsonl minus the time just before the command started; "ends" is when the command has exited (what a
test or a requeued job waits for); "import" is `python -c "import hpctrain.train.run"` alone (the heavy
imports: torch, the loop). With --before, every phase also runs the code under OLD_CHECKOUT/src (by PYTHONPATH),
interleaved with this checkout's src run for run, so both see the same machine. Median [min, max].
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

COMMON = ["log.every_steps=1", "log.plots=false", "log.tensorboard=false", "data.num_workers=0", "model.width=8"]
HERE = Path(__file__).resolve().parents[1] / "src"


def env_for(src: Path) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(src)}


def run_s(src: Path, run_dir: Path, nproc: int, max_steps: int) -> tuple[float, float]:
    """(first step, end) in seconds from the command's start."""
    cmd = [sys.executable, "-m", "hpctrain", "train", "digits", f"run.dir={run_dir}", f"train.max_steps={max_steps}",
           *COMMON] + (["--nproc-per-node", str(nproc)] if nproc > 1 else [])
    started = time.time()
    out = subprocess.run(cmd, capture_output=True, text=True, check=False, env=env_for(src))
    ended = time.time()
    if out.returncode != 0:
        kept = Path(tempfile.gettempdir()) / f"hpctrain-bench-failed-{run_dir.name}.log"
        kept.write_text(out.stderr)
        raise SystemExit(f"{' '.join(cmd)}\nexited {out.returncode}; its whole stderr: {kept}")
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    first = min(r["time"] for r in records if r["split"] == "train" and r["step"] == max_steps)
    return first - started, ended - started


def import_s(src: Path) -> float:
    started = time.perf_counter()
    subprocess.run([sys.executable, "-c", "import hpctrain.train.run"], check=True, env=env_for(src))
    return time.perf_counter() - started


def measure(src: Path, tmp: Path, tag: str, i: int, rows: dict[str, list[float]]) -> None:
    rows.setdefault(f"{tag}import hpctrain.train.run", []).append(import_s(src))
    for nproc in (1, 2):
        fresh = tmp / f"{tag}fresh{nproc}_{i}"
        first, end = run_s(src, fresh, nproc, 1)
        rows.setdefault(f"{tag}{nproc} process(es): fresh start -> step 1 | ends", []).append((first, end))
        # The same run dir again, one step further: load the checkpoint of step 1, then step 2.
        first, end = run_s(src, fresh, nproc, 2)
        rows.setdefault(f"{tag}{nproc} process(es): resume -> next step | ends", []).append((first, end))


def cell(values: list[float]) -> str:
    return f"{statistics.median(values):.2f} [{min(values):.2f}, {max(values):.2f}]"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--before", type=Path, help="another checkout's src folder to compare with, run for run")
    args = p.parse_args()
    trees = [("before: ", args.before.resolve()), ("after: ", HERE)] if args.before else [("", HERE)]
    rows: dict[str, list] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.repeats):
            for tag, src in trees:
                measure(src, Path(tmp), tag, i, rows)
    print(f"\nmedian [min, max] of {args.repeats}, seconds from the command's start\n")
    print("| phase | first step | command ends |")
    print("|---|---:|---:|")
    for name, values in sorted(rows.items(), key=lambda kv: (kv[0].split(": ")[-1], kv[0])):
        if isinstance(values[0], tuple):
            print(f"| {name.split(' | ')[0]} | {cell([v[0] for v in values])} | {cell([v[1] for v in values])} |")
        else:
            print(f"| {name} | {cell(values)} | |")


if __name__ == "__main__":
    main()
