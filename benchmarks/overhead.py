"""Training-loop overhead: a plain hand-written DDP loop, hpctrain, Lightning Fabric and Hugging Face Accelerate
on the same model, data and optimizer. Prints a table.

    pip install lightning accelerate     # the peers (not hpctrain dependencies)
    python benchmarks/overhead.py [--model mlp|tiny] [--repeats 5] [--nproc 2]

Every variant runs under torchrun with --nproc processes (gloo on CPU; on a GPU machine the peers
would need their GPU settings, not done here), AdamW, micro batch per rank from an in-memory tensor
set, no loader workers, fp32, no clipping, no EMA. Two models:

  mlp   an MLP 784-1024-1024-10 (1.9M parameters), micro batch 128: the loop's share of a real step
        (steps/s).
  tiny  Linear 8->1, micro batch 1: a near-null step, so what is left is each loop's own per-step work
        (ms per step, and ms over the plain loop). On a GPU that work is what limits a small model: the CPU
        must stay ahead of the kernels. Adds a row: the plain loop plus hpctrain's own stop-signal vote
        (hpctrain.fault.vote.StepVote at every step boundary), the share of hpctrain's cost that is the vote.
        With --nproc 1 (no DDP, no collective: hpctrain trains in the launching process, the others under
        torchrun) what is left is each loop's own Python per step, without the gloo noise of two processes
        on a small machine.

Two more rows measure the levels at which a user brings their own training (issue 40): `session`, the plain loop
written as a loop of its own under hpctrain.session() (overhead_session.py; goal: within 3% of `plain`), and
`step`, the same step as a StepExperiment (overhead:MlpStep / TinyStep, hpctrain's loop around the experiment's
train_step; goal: within 3% of `hpctrain`, the equivalent Experiment).

Time over `measured` steps after `warmup`, between two synchronising points (barriers for the peers;
hpctrain's log records at those steps, which follow its loss all-reduce). hpctrain runs as a user
runs it (`hpctrain train`): its per-step work (heartbeat, stop-signal vote, loss bookkeeping, a log
record every `warmup` steps) is part of what is measured; its checkpoint at the end falls after the
window. Runs are interleaved, in rotating order; median [min, max]. A peer that is not installed is
skipped and said so in the table.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import TensorDataset

from hpctrain.experiments.base import Datasets, Experiment
from hpctrain.experiments.step_experiment import StepExperiment

LR = 1e-3
HERE = Path(__file__).resolve().parent
PEER_PACKAGES = {"fabric": "lightning", "accelerate": "accelerate"}
"""Peers that are not hpctrain dependencies: the package each needs."""


@dataclass(frozen=True)
class Workload:
    experiment: str
    """Its hpctrain experiment in this file."""
    warmup: int
    measured: int
    micro_batch: int
    samples: int
    """Enough that the measured window stays inside the first epoch."""
    variants: tuple[str, ...] = ("plain", "session", "hpctrain", "step", "fabric", "accelerate")


WORKLOADS = {
    "mlp": Workload("Mlp", warmup=50, measured=300, micro_batch=128, samples=16384),
    "tiny": Workload("Tiny", warmup=200, measured=3000, micro_batch=1, samples=16384,
                     variants=("plain", "plain+vote", "session", "hpctrain", "step", "fabric", "accelerate")),
}


def build_model(name: str) -> nn.Module:
    torch.manual_seed(0)
    if name == "tiny":
        return nn.Linear(8, 1)
    return nn.Sequential(nn.Linear(784, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 10))


def build_data(name: str) -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    n = WORKLOADS[name].samples
    if name == "tiny":
        return TensorDataset(torch.randn(n, 8, generator=g), torch.randn(n, 1, generator=g))
    return TensorDataset(torch.randn(n, 784, generator=g), torch.randint(0, 10, (n,), generator=g))


def loss_fn(name: str, out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return nn.functional.mse_loss(out, y) if name == "tiny" else nn.functional.cross_entropy(out, y)


class _Overhead(Experiment):
    workload = ""

    def build_model(self) -> nn.Module:
        return build_model(self.workload)

    def build_datasets(self) -> Datasets:
        return Datasets(train=build_data(self.workload))

    def train_loss(self, model: nn.Module, batch) -> torch.Tensor:
        x, y = batch
        return loss_fn(self.workload, model(x), y)


class Mlp(_Overhead):
    """The mlp workload as an hpctrain experiment."""

    name, workload = "overhead-mlp", "mlp"


class Tiny(_Overhead):
    """The tiny workload as an hpctrain experiment."""

    name, workload = "overhead-tiny", "tiny"


class _OverheadStep(StepExperiment):
    """The same workload as a StepExperiment: the step an Experiment's loop makes, written out (accumulation 1)."""

    workload = ""

    def build_models(self):
        return {"model": build_model(self.workload)}

    def build_optimizers(self, models):
        return {"opt": torch.optim.AdamW(models["model"].parameters(), lr=LR, weight_decay=0.01)}

    def build_datasets(self) -> Datasets:
        return Datasets(train=build_data(self.workload))

    def train_step(self, step) -> None:
        model = step.models["model"]
        for (x, y), _ in step.micro_batches():
            loss = loss_fn(self.workload, model(x), y)
            step.backward(loss)
            step.log(loss=loss.detach())
        step.optimizer_step()


class MlpStep(_OverheadStep):
    name, workload = "overhead-mlp-step", "mlp"


class TinyStep(_OverheadStep):
    name, workload = "overhead-tiny-step", "tiny"


def env() -> dict[str, str]:
    # One intra-op thread per process, as torchrun sets for several: the same for every loop with --nproc 1 too.
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]),
            "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}


def run_peer(variant: str, model: str, nproc: int, tmp: Path) -> float:
    """Seconds per step."""
    out = tmp / f"{variant}.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           str(HERE / "overhead_worker.py"), variant, model, str(out)]
    _check(subprocess.run(cmd, capture_output=True, text=True, env=env(), cwd=tmp), cmd, variant)
    return 1 / json.loads(out.read_text())["steps_per_s"]


def run_hpctrain(model: str, nproc: int, tmp: Path, i: int, variant: str = "hpctrain") -> float:
    """Seconds per step of hpctrain's own loop: an Experiment (hpctrain), a StepExperiment (step), or a loop of the
    user's own under hpctrain.session() (session)."""
    w = WORKLOADS[model]
    run_dir = tmp / f"{variant}{i}"
    if variant == "session":
        start = [sys.executable, "-m", "hpctrain.launch", "--standalone", f"--nproc-per-node={nproc}",
                 str(HERE / "overhead_session.py"), model]
    else:
        experiment = w.experiment + ("Step" if variant == "step" else "")
        start = [sys.executable, "-m", "hpctrain", "train", f"overhead:{experiment}", "--nproc-per-node", str(nproc)]
    cmd = [*start, f"run.dir={run_dir}", f"train.max_steps={w.warmup + w.measured}",
           f"train.global_batch_size={w.micro_batch * nproc}", f"train.micro_batch_size={w.micro_batch}",
           f"optim.lr={LR}", "optim.warmup_steps=0", "optim.weight_decay=0.01",
           "train.grad_clip=0", "train.precision=fp32", "data.num_workers=0", "data.augment=false",
           f"log.every_steps={w.warmup}", "log.tensorboard=false", "log.plots=false", "ckpt.every_minutes=0"]
    _check(subprocess.run(cmd, capture_output=True, text=True, env=env(), cwd=tmp), cmd, variant)
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    at = {r["step"]: r["time"] for r in records if r.get("split") == "train"}
    return (at[w.warmup + w.measured] - at[w.warmup]) / w.measured


def _check(done: subprocess.CompletedProcess, cmd: list[str], name: str) -> None:
    if done.returncode != 0:
        kept = Path(tempfile.gettempdir()) / f"hpctrain-bench-overhead-{name}.log"
        kept.write_text(done.stdout + done.stderr)
        raise SystemExit(f"{name}: {' '.join(cmd)}\nexited {done.returncode}; its output: {kept}")


def missing_package(variant: str) -> str:
    """The package a peer needs and this environment lacks ('' when it can run)."""
    package = PEER_PACKAGES.get(variant, "")
    return package if package and importlib.util.find_spec(package) is None else ""


def measure(model: str, variants: list[str], repeats: int, nproc: int) -> dict[str, list[float]]:
    """Seconds per step of each variant, one per repeat; runs interleaved in rotating order."""
    times: dict[str, list[float]] = {v: [] for v in variants}
    with tempfile.TemporaryDirectory() as name:
        tmp = Path(name)
        for i in range(repeats):
            order = variants[i % len(variants):] + variants[:i % len(variants)]  # rotate: no fixed position
            for v in order:
                ours = v in ("hpctrain", "session", "step")
                t = run_hpctrain(model, nproc, tmp, i, v) if ours else run_peer(v, model, nproc, tmp)
                times[v].append(t)
                print(f"  run {i + 1}: {v} {1e3 * t:.3f} ms/step", file=sys.stderr)
    return times


def _spread(values: list[float], fmt: str) -> str:
    return f"{statistics.median(values):{fmt}} [{min(values):{fmt}}, {max(values):{fmt}}]"


def print_rates(times: dict[str, list[float]], skipped: dict[str, str]) -> None:
    """mlp: steps/s, and the ratio of medians to the plain loop."""
    print("| loop | steps/s | vs plain | per-round ratio to its reference |")
    print("|---|---:|---:|---:|")
    base = statistics.median(1 / t for t in times["plain"])
    for v, t in times.items():
        rates = [1 / x for x in t]
        reference = REFERENCE.get(v)
        paired = ""
        if reference in times:  # each round's two runs ran back to back: the ratio of the pair, median and spread
            paired = f"{_spread([b / a for a, b in zip(t, times[reference])], '.3f')} vs {reference}"
        print(f"| {v} | {_spread(rates, '.2f')} | {statistics.median(rates) / base:.3f} | {paired} |")
    _print_skipped(skipped)


REFERENCE = {"session": "plain", "step": "hpctrain"}
"""The loop each level of bringing one's own training is held to (within 3%)."""


def print_costs(times: dict[str, list[float]], skipped: dict[str, str]) -> None:
    """tiny: ms per step, and ms over the plain loop of the same repeat (runs of one repeat ran back to back)."""
    print("| loop | ms per step | ms over plain |")
    print("|---|---:|---:|")
    for v, t in times.items():
        over = [1e3 * (a - b) for a, b in zip(t, times["plain"])]
        print(f"| {v} | {_spread([1e3 * x for x in t], '.3f')} | {'' if v == 'plain' else _spread(over, '+.3f')} |")
    _print_skipped(skipped)


def _print_skipped(skipped: dict[str, str]) -> None:
    for v, package in skipped.items():
        print(f"| {v} | not installed: skipped (pip install {package}) | |")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", choices=sorted(WORKLOADS), default="mlp")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--nproc", type=int, default=2)
    args = p.parse_args()
    skipped = {v: package for v in PEER_PACKAGES if (package := missing_package(v))}
    w = WORKLOADS[args.model]
    variants = [v for v in w.variants if v not in skipped]
    times = measure(args.model, variants, args.repeats, args.nproc)
    print(f"\n{args.model}: {args.nproc} processes, gloo on CPU, {w.measured} steps after {w.warmup}; "
          f"median [min, max] of {args.repeats}\n")
    (print_costs if args.model == "tiny" else print_rates)(times, skipped)


if __name__ == "__main__":
    main()
