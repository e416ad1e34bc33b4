"""torch.compile across a requeue: what the second launch of a compiled run pays for compilation, with the run's
compile cache (hpctrain.train.compile_cache) against the first launch's cold compile. Prints a table.

    python benchmarks/compile_cache.py [--device auto|cuda|cpu] [--steps 3] [--repeats 2] [--json PATH]

Each repeat runs four launches of `hpctrain train ddpm_cifar10` (source=fixture; the tiny U-Net on the CPU, the
reference U-Net at micro batch 64 on CUDA), each in a fresh process with a fresh, empty TMPDIR (the node-local
compile caches start empty, as on another node): a run of 2 x --steps steps stopped after --steps
(train.stop_at_step, with a checkpoint), then resumed to its end, each launch validating at its end (so each compiles the validation's shapes
too); once with train.step_mode=eager and once with train.step_mode=compiled. The
compilation's price in a launch is its wall time minus the eager launch's at the same position: cold (the first
launch: nothing cached) and warm (the resumed launch: the run dir's compile-cache blob, written at the first
launch's checkpoint). Goal of the step-off-the-host issue: warm <= 25% of cold.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TINY = ("model.image_size=16", "model.ch=16", "model.ch_mult=[1, 2]", "model.num_res_blocks=1",
        "model.attn_resolutions=[8]", "model.norm_groups=8", "train.global_batch_size=8", "train.micro_batch_size=8",
        "train.precision=fp32")
REFERENCE = ("train.global_batch_size=64", "train.micro_batch_size=64", "train.precision=bf16")


def launch(run_dir: Path, mode: str, steps: int, stop: int, cuda: bool, scratch: Path) -> float:
    """One `hpctrain train` launch in a fresh process with empty local compile caches; its wall time."""
    args = [sys.executable, "-m", "hpctrain", "train", "ddpm_cifar10", "model.source=fixture",
            "model.fixture_samples=256", f"run.dir={run_dir}", f"train.step_mode={mode}", f"train.max_steps={steps}",
            f"train.stop_at_step={stop}", f"eval.every_steps={steps // 2}", "log.plots=false", "log.progress=off",
            "log.tensorboard=false", "log.outputs_every_steps=0", "log.outputs_every_epochs=0",
            "data.num_workers=0", *(REFERENCE if cuda else TINY)]
    # A fresh TMPDIR: the node-local cache folders (hpctrain's and Inductor's default) start empty, as on another
    # node; hpctrain manages TORCHINDUCTOR_CACHE_DIR itself unless it is set, so it is not.
    env = {k: v for k, v in os.environ.items() if k not in ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR")}
    env |= {"TMPDIR": tempfile.mkdtemp(dir=scratch),
            "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT / "src"), os.environ.get("PYTHONPATH", "")) if p)}
    started = time.perf_counter()
    proc = subprocess.run(args, env=env, capture_output=True, text=True, timeout=1800)
    seconds = time.perf_counter() - started
    if proc.returncode != 0:
        raise SystemExit(f"launch failed ({mode}, stop {stop}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    if mode == "compiled" and stop == steps and "compile cache: unpacked" not in proc.stderr:
        raise SystemExit(f"the resumed compiled launch did not load the run's compile cache:\n{proc.stderr[-3000:]}")
    return seconds


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto")
    p.add_argument("--steps", type=int, default=3, help="steps per launch (default 3)")
    p.add_argument("--repeats", type=int, default=2, help="repeats of the four launches (default 2)")
    p.add_argument("--json", default="", metavar="PATH")
    args = p.parse_args(argv)
    import torch

    cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    if cuda and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device visible")
    if not cuda:
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
    times: dict[str, list[float]] = {k: [] for k in ("eager 1", "compiled 1", "eager 2", "compiled 2")}
    with tempfile.TemporaryDirectory(prefix="hpctrain-compile-cache-") as scratch:
        for r in range(args.repeats):
            for mode in ("eager", "compiled") if r % 2 == 0 else ("compiled", "eager"):
                run_dir = Path(scratch) / f"{mode}-{r}"
                for n, stop in ((1, args.steps), (2, 2 * args.steps)):
                    seconds = launch(run_dir, mode, 2 * args.steps, stop, cuda, Path(scratch))
                    times[f"{mode} {n}"].append(seconds)
                    print(f"  repeat {r + 1}: {mode} launch {n}: {seconds:.1f} s", file=sys.stderr, flush=True)
    cold = [c - e for c, e in zip(times["compiled 1"], times["eager 1"])]
    warm = [c - e for c, e in zip(times["compiled 2"], times["eager 2"])]
    ratio = statistics.median(warm) / statistics.median(cold) if statistics.median(cold) > 0 else float("nan")
    device = torch.cuda.get_device_name() if cuda else "cpu"
    print(f"# compile cache across a requeue: {device} | torch {torch.__version__} | "
          f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC | DDPM U-Net "
          f"({'reference, micro 64, bf16' if cuda else 'tiny, fp32'}), {args.steps} steps per launch, "
          f"median of {args.repeats} [min, max]\n")
    print("| launch | eager s | compiled s | compilation's price s |\n|---|---:|---:|---:|")
    labels = ((1, "first (cold: nothing cached)", cold), (2, "resumed (warm: the run's packed cache)", warm))
    for n, label, price in labels:
        e, c = times[f"eager {n}"], times[f"compiled {n}"]
        print(f"| {label} | {statistics.median(e):.1f} | {statistics.median(c):.1f} | "
              f"{statistics.median(price):.1f} [{min(price):.1f}, {max(price):.1f}] |")
    print(f"\nwarm / cold compilation: {ratio:.2f} (goal <= 0.25)")
    report = {"device": device, "torch": torch.__version__, "steps": args.steps, "times": times, "cold": cold,
              "warm": warm, "ratio": ratio}
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1) + "\n")
    return report


if __name__ == "__main__":
    main()
