"""Time from process start to the first optimizer step, which a requeued job pays at every restart. Prints a table.

    python benchmarks/startup.py [--repeats 5]

For the digits demo (gloo on CPU): a fresh start and a resume from a checkpoint, on 1 process and on 2
(torchrun). "first step" is the wall-clock time of the first train record (log.every_steps=1) in
metrics.jsonl minus the time just before the command started; "import" is `python -c "import
hpctrain.train.run"` alone (the heavy imports: torch, the loop). Runs are interleaved; median [min, max].
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

COMMON = ["log.every_steps=1", "log.plots=false", "log.tensorboard=false", "data.num_workers=0", "model.width=8"]


def first_step_s(run_dir: Path, nproc: int, max_steps: int) -> float:
    cmd = [sys.executable, "-m", "hpctrain", "train", "digits", f"run.dir={run_dir}", f"train.max_steps={max_steps}",
           *COMMON] + (["--nproc-per-node", str(nproc)] if nproc > 1 else [])
    started = time.time()
    out = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if out.returncode != 0:
        kept = Path(tempfile.gettempdir()) / f"hpctrain-bench-failed-{run_dir.name}.log"
        kept.write_text(out.stderr)
        raise SystemExit(f"{' '.join(cmd)}\nexited {out.returncode}; its whole stderr: {kept}")
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    first = min(r["time"] for r in records if r["split"] == "train" and r["step"] == max_steps)
    return first - started


def import_s() -> float:
    started = time.perf_counter()
    subprocess.run([sys.executable, "-c", "import hpctrain.train.run"], check=True)
    return time.perf_counter() - started


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args()
    rows: dict[str, list[float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.repeats):
            rows.setdefault("import hpctrain.train.run", []).append(import_s())
            for nproc in (1, 2):
                fresh = Path(tmp) / f"fresh{nproc}_{i}"
                rows.setdefault(f"{nproc} process(es): fresh start -> step 1", []).append(first_step_s(fresh, nproc, 1))
                # The same run dir again, one step further: load the checkpoint of step 1, then step 2.
                rows.setdefault(f"{nproc} process(es): resume -> next step", []).append(first_step_s(fresh, nproc, 2))
    print(f"\nmedian [min, max] of {args.repeats}, seconds\n")
    print("| phase | seconds |")
    print("|---|---:|")
    for name, values in rows.items():
        print(f"| {name} | {statistics.median(values):.2f} [{min(values):.2f}, {max(values):.2f}] |")


if __name__ == "__main__":
    main()
