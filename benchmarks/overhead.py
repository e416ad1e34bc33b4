"""Training-loop overhead: steps/s of a plain hand-written DDP loop, hpctrain, Lightning Fabric and
Hugging Face Accelerate on the same model, data and optimizer. Prints a table.

    pip install lightning accelerate     # the peers (not hpctrain dependencies)
    python benchmarks/overhead.py [--repeats 5] [--nproc 2]

Every variant runs under torchrun with --nproc processes (gloo on CPU; on a GPU machine the peers
would need their GPU settings, not done here): an MLP 784-1024-1024-10 (1.9M parameters), AdamW,
micro batch 128 per rank from an in-memory tensor set, no loader workers, fp32, no clipping, no EMA.
Steps/s over MEASURED steps after WARMUP, timed between two synchronising points (barriers for the
peers; hpctrain's log records at those steps, which follow its loss all-reduce). hpctrain runs as a
user runs it (`hpctrain train`): its per-step work (heartbeat, stop-signal vote, loss bookkeeping,
log every 50 steps) is part of what is measured; its checkpoint at the end falls after the window.
Runs are interleaved, in rotating order; median [min, max]; ratios are of medians to the plain loop.
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

import torch
from torch import nn
from torch.utils.data import TensorDataset

from hpctrain.experiments.base import Datasets, Experiment

WARMUP, MEASURED, MICRO_BATCH, LR, SAMPLES = 50, 300, 128, 1e-3, 16384
HERE = Path(__file__).resolve().parent
PEERS = ("plain", "fabric", "accelerate")


def build_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(784, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 10))


def build_data() -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(SAMPLES, 784, generator=g), torch.randint(0, 10, (SAMPLES,), generator=g))


class Mlp(Experiment):
    """The overhead benchmark's model and data as an hpctrain experiment."""

    name = "overhead-mlp"

    def build_model(self) -> nn.Module:
        return build_model()

    def build_datasets(self) -> Datasets:
        return Datasets(train=build_data())

    def train_loss(self, model: nn.Module, batch) -> torch.Tensor:
        x, y = batch
        return nn.functional.cross_entropy(model(x), y)


def env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")])}


def run_peer(variant: str, nproc: int, tmp: Path) -> float:
    out = tmp / f"{variant}.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           str(HERE / "overhead_worker.py"), variant, str(out)]
    _check(subprocess.run(cmd, capture_output=True, text=True, env=env(), cwd=tmp), cmd, variant)
    return json.loads(out.read_text())["steps_per_s"]


def run_hpctrain(nproc: int, tmp: Path, i: int) -> float:
    run_dir = tmp / f"hpctrain{i}"
    world_batch = MICRO_BATCH * nproc
    cmd = [sys.executable, "-m", "hpctrain", "train", "overhead:Mlp", "--nproc-per-node", str(nproc),
           f"run.dir={run_dir}", f"train.max_steps={WARMUP + MEASURED}", f"train.global_batch_size={world_batch}",
           f"train.micro_batch_size={MICRO_BATCH}", f"optim.lr={LR}", "optim.warmup_steps=0", "optim.weight_decay=0.01",
           "train.grad_clip=0", "train.precision=fp32", "data.num_workers=0", "data.augment=false",
           f"log.every_steps={WARMUP}", "log.tensorboard=false", "log.plots=false", "ckpt.every_minutes=0"]
    _check(subprocess.run(cmd, capture_output=True, text=True, env=env(), cwd=tmp), cmd, "hpctrain")
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    at = {r["step"]: r["time"] for r in records if r.get("split") == "train"}
    return MEASURED / (at[WARMUP + MEASURED] - at[WARMUP])


def _check(done: subprocess.CompletedProcess, cmd: list[str], name: str) -> None:
    if done.returncode != 0:
        kept = Path(tempfile.gettempdir()) / f"hpctrain-bench-overhead-{name}.log"
        kept.write_text(done.stdout + done.stderr)
        raise SystemExit(f"{name}: {' '.join(cmd)}\nexited {done.returncode}; its output: {kept}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--nproc", type=int, default=2)
    args = p.parse_args()
    variants = ["plain", "hpctrain", "fabric", "accelerate"]
    rates: dict[str, list[float]] = {v: [] for v in variants}
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.repeats):
            order = variants[i % len(variants):] + variants[:i % len(variants)]  # rotate: no fixed position
            for v in order:
                rate = run_hpctrain(args.nproc, Path(tmp), i) if v == "hpctrain" else run_peer(v, args.nproc, Path(tmp))
                rates[v].append(rate)
                print(f"  run {i + 1}: {v} {rate:.2f} steps/s", file=sys.stderr)
    base = statistics.median(rates["plain"])
    print(f"\n{args.nproc} processes, gloo on CPU, {MEASURED} steps after {WARMUP}; median [min, max] of {args.repeats}\n")
    print("| loop | steps/s | vs plain |")
    print("|---|---:|---:|")
    for v in variants:
        r = rates[v]
        print(f"| {v} | {statistics.median(r):.2f} [{min(r):.2f}, {max(r):.2f}] | {statistics.median(r) / base:.3f} |")


if __name__ == "__main__":
    main()
