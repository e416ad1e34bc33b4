"""Does face parsing learn? The ``faceseg`` config on generated faces, 2 processes on this machine's CPU.

CelebAMask-HQ cannot be downloaded here, so this is the end-to-end check of the segmentation code:

    python tools/faceseg_quality.py [--faces data/faces] [--count 3000] [--run-dir runs/faceseg-quality]
                                    [--nproc 2] [--out docs] [key=value ...]

generates the faces when the folder is missing (``hpctrain synth faces``), trains ``faceseg`` (ResNet-18
DeepLabV3+, 128x128, from scratch) on ``--nproc`` processes, and prints the wall time, the final validation
mIoU, pixel accuracy and mean F1, and the per-class IoU, all read back from the run's metrics.jsonl (nothing here
computes a metric). ``--out`` copies the run's comparison picture and curves there (the docs' figures).
Goal: mIoU >= the figure stated in README.md within 15 minutes on 2 CPU cores.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path

from hpctrain.datasets.sources.celebamask import CLASSES
from hpctrain.metrics.records import read_metrics
from hpctrain.metrics.segmentation import iou_table


def hpctrain(*args: str) -> None:
    subprocess.run([sys.executable, "-m", "hpctrain", *args], check=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--faces", default="data/faces", help="generated face set (made when missing)")
    parser.add_argument("--count", type=int, default=3000, help="faces to generate when the set is missing")
    parser.add_argument("--run-dir", default="runs/faceseg-quality", help="the training run (must not exist)")
    parser.add_argument("--nproc", type=int, default=2, help="training processes")
    parser.add_argument("--out", default="", help="copy the comparison picture and curves into this folder")
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides for the run")
    args = parser.parse_args(argv)
    faces, run_dir = Path(args.faces), Path(args.run_dir)
    if run_dir.exists():
        raise SystemExit(f"{run_dir} exists: give a new --run-dir (this script measures a whole run)")
    if not faces.exists():
        hpctrain("synth", "faces", str(faces), "--count", str(args.count))
    started = time.perf_counter()
    hpctrain("train", "faceseg", f"model.data_root={faces}", f"run.dir={run_dir}", "log.progress=lines",
             f"--nproc-per-node={args.nproc}", *args.overrides)
    seconds = time.perf_counter() - started
    val = [r for r in read_metrics(run_dir / "metrics.jsonl") if r["split"] == "val"]
    last = val[-1]
    print(f"\nfaceseg on generated faces ({faces}), {args.nproc} processes, {os.cpu_count()} CPUs, "
          f"{platform.processor() or platform.machine()}, {datetime.date.today()}")
    print("| steps | wall time (s) | mIoU % | mIoU w/o background % | pixel accuracy % | mean F1 % |")
    print("|---:|---:|---:|---:|---:|---:|")
    print(f"| {last['step']} | {seconds:.0f} | {100 * last['miou']:.2f} | {100 * last['miou_fg']:.2f} | "
          f"{100 * last['pixel_acc']:.2f} | {100 * last['mean_f1']:.2f} |")
    print("\nmIoU by validation:", ", ".join(f"step {r['step']}: {100 * r['miou']:.2f}" for r in val))
    print("\n" + iou_table(last, CLASSES))
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        for tag in ("comparison", "curves"):
            latest = sorted((run_dir / "images" / tag).glob("step_*.png"))[-1]
            shutil.copyfile(latest, out / f"faceseg-{tag}.png")
            print(f"{tag}: {out / f'faceseg-{tag}.png'} (from {latest})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
