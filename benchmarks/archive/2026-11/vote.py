"""Per-step cost of the stop vote on a launch-bound model: none, the pre-fix vote (a CUDA flags tensor
all-reduced on NCCL and read back with .tolist(): a host-to-device copy and a device synchronisation each step),
and hpctrain's StepVote on NCCL (pinned buffers and an event: waits for the previous step, not the one just
queued). Prints a table.

    python benchmarks/archive/2026-11/vote.py [--steps 300] [--repeats 5] [--layers 24] [--width 256]

One process with a world-size-1 process group (NCCL when CUDA is there, else gloo): a
one-rank NCCL all-reduce still launches its kernel and the .tolist() still waits for every queued kernel,
which is the cost in question; the network part of a real multi-node vote is hidden by design (cast at
one step, collected at the next) in both variants. The model is a stack of small Linear layers at batch 8:
its step is kernel-launch bound, so the CPU must stay ahead of the GPU, which a per-step synchronisation
prevents. Runs are interleaved; median [min, max] of ms per step; the ratio is to 'none'.
Without CUDA: none and StepVote on gloo only (plumbing; the question is a GPU's).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import os
import statistics
import tempfile
import time

import torch
import torch.distributed as dist
from torch import nn

from hpctrain.dist.runtime import single_process_runtime
from hpctrain.fault.vote import StepVote


class PreFixVote:
    """The vote as it was before the control plane (kept here only for this comparison)."""

    def __init__(self, device: torch.device) -> None:
        self.device, self.pending = device, None

    def cast(self, stop_signal: int, save_due: bool) -> None:
        flags = torch.tensor([float(stop_signal), float(save_due)], device=self.device)
        self.pending = (flags, dist.all_reduce(flags, op=dist.ReduceOp.MAX, async_op=True))

    def collect(self) -> None:
        if self.pending is not None:
            flags, work = self.pending
            work.wait()
            flags.tolist()


class NoVote:
    def cast(self, stop_signal: int, save_due: bool) -> None:
        pass

    def collect(self) -> None:
        pass


def model_and_optimizer(device: torch.device, layers: int, width: int):
    torch.manual_seed(0)
    model = nn.Sequential(*[m for _ in range(layers) for m in (nn.Linear(width, width), nn.GELU())]).to(device)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)


def run(vote, model, optimizer, x: torch.Tensor, steps: int) -> float:
    """ms per step, the loop shaped as hpctrain's: step, then collect the previous vote, then cast."""
    sync = torch.cuda.synchronize if x.is_cuda else (lambda: None)
    sync()
    started = time.perf_counter()
    for _ in range(steps):
        model(x).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        vote.collect()
        vote.cast(0, False)
    vote.collect()
    sync()
    return (time.perf_counter() - started) * 1000 / steps


def init_group(cuda: bool, store_dir: str) -> None:
    store = dist.FileStore(os.path.join(store_dir, "store"), 1)
    dist.init_process_group("nccl" if cuda else "gloo", store=store, rank=0, world_size=1,
                            device_id=torch.device("cuda", 0) if cuda else None)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--width", type=int, default=256)
    args = parser.parse_args()
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    with tempfile.TemporaryDirectory() as store_dir:
        init_group(cuda, store_dir)
        # world_size 2 makes StepVote all-reduce (on the one-rank group), as it does in a real run.
        runtime = dataclasses.replace(single_process_runtime(device), world_size=2, backend="nccl" if cuda else "gloo")
        variants = {"none": NoVote(), f"stepvote ({runtime.backend})": StepVote(runtime)}
        if cuda:
            variants["pre-fix (nccl + .tolist())"] = PreFixVote(device)
        model, optimizer = model_and_optimizer(device, args.layers, args.width)
        x = torch.randn(8, args.width, device=device)
        for vote in variants.values():
            run(vote, model, optimizer, x, 30)  # warm-up: allocator, kernels, gloo/NCCL connections
        times: dict[str, list[float]] = {name: [] for name in variants}
        for r in range(args.repeats):
            names = list(variants)
            for name in names[r % len(names):] + names[:r % len(names)]:  # rotate the order
                times[name].append(run(variants[name], model, optimizer, x, args.steps))
        dist.destroy_process_group()
    report(times, device, args)


def report(times: dict[str, list[float]], device: torch.device, args: argparse.Namespace) -> None:
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    nccl = ".".join(map(str, torch.cuda.nccl.version())) if device.type == "cuda" else "-"
    print(f"# vote cost: {name}, torch {torch.__version__}, CUDA {torch.version.cuda}, NCCL {nccl}, "
          f"{datetime.date.today()}; {args.layers} x Linear({args.width}) at batch 8, {args.steps} steps x "
          f"{args.repeats}")
    if device.type != "cuda":
        print("# no CUDA device: the pre-fix NCCL variant is skipped (run on a GPU node)")
    base = statistics.median(times["none"])
    print(f"| {'variant':<32} | {'ms/step median [min, max]':<27} | {'vs none':>8} |")
    print(f"|{'-' * 34}|{'-' * 29}|{'-' * 10}|")
    for variant, ts in times.items():
        med = statistics.median(ts)
        spread = f"{med:.3f} [{min(ts):.3f}, {max(ts):.3f}]"
        print(f"| {variant:<32} | {spread:<27} | {med / base:>7.3f}x |")


if __name__ == "__main__":
    main()
