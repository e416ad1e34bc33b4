"""Weak scaling of the digits demo: a fixed micro-batch per process, 1, 2 and 4 processes. Prints a table.

    python benchmarks/archive/2026-11/scaling.py [--repeats 3] [--procs 1 2 4] [--micro 25] [--steps 60]

Global batch = micro x processes (no accumulation), so each process does the same work per step and
ideal scaling keeps steps/s constant. Throughput is the median of the logged samples_per_s records after
the first (which holds start-up), per run; efficiency = samples/s at N / (N x samples/s at 1). On a
machine with C cores, more than C processes share cores: efficiency then measures oversubscription, and
the table says how many cores there were. Every process runs one intra-op thread (OMP_NUM_THREADS=1, what
torchrun sets), the single process too. Interleaved runs, median over repeats.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path


def samples_per_s(run_dir: Path, nproc: int, micro: int, steps: int) -> float:
    cmd = [sys.executable, "-m", "hpctrain", "train", "digits", f"run.dir={run_dir}", f"train.max_steps={steps}",
           f"train.micro_batch_size={micro}", f"train.global_batch_size={micro * nproc}", "log.every_steps=10",
           "log.plots=false", "log.tensorboard=false", "data.num_workers=0", "eval.every_steps=100000",
           "ckpt.every_steps=0"]
    if nproc > 1:
        cmd += ["--nproc-per-node", str(nproc)]
    # One thread per process, as torchrun sets for its workers: otherwise the single process would use
    # every core through intra-op threads and the comparison would not be per process.
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    out = subprocess.run(cmd, capture_output=True, text=True, check=False, env=env)
    if out.returncode != 0:
        kept = Path(tempfile.gettempdir()) / f"hpctrain-bench-failed-{run_dir.name}.log"
        kept.write_text(out.stderr)
        raise SystemExit(f"{' '.join(cmd)}\nexited {out.returncode}; its whole stderr: {kept}")
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    rates = [r["samples_per_s"] for r in records if r["split"] == "train"][1:]
    return statistics.median(rates)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--procs", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--micro", type=int, default=25)
    p.add_argument("--steps", type=int, default=60)
    args = p.parse_args()
    rates: dict[int, list[float]] = {n: [] for n in args.procs}
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.repeats):
            for n in args.procs:
                rates[n].append(samples_per_s(Path(tmp) / f"n{n}_{i}", n, args.micro, args.steps))
    base = statistics.median(rates[args.procs[0]]) / args.procs[0]
    print(f"\nweak scaling, digits, micro-batch {args.micro} per process, gloo on CPU, "
          f"{len(os.sched_getaffinity(0))} cores, median of {args.repeats}\n")
    print("| processes | samples/s | per process | efficiency |")
    print("|---:|---:|---:|---:|")
    for n in args.procs:
        r = statistics.median(rates[n])
        print(f"| {n} | {r:,.0f} | {r / n:,.0f} | {r / (n * base):.0%} |")


if __name__ == "__main__":
    main()
