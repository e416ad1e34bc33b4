"""torch.compile and DDP: step time of eager DDP, a compiled module inside DDP (hpctrain's order before
issue 13) and DDP inside torch.compile (torch's documented order, hpctrain's now). Prints a table.

    python benchmarks/archive/2026-11/compile_order.py [--nproc 2] [--steps 50] [--repeats 3] [--layers 16] [--width 1024]

Runs itself under torchrun with --nproc processes: NCCL when every process has a GPU of its own, gloo
otherwise (two processes sharing one GPU cannot form an NCCL communicator: NCCL refuses a duplicate GPU, so
on a one-GPU machine the all-reduces go through gloo, which copies CUDA tensors to the host). The model is a
stack of Linear layers with small DDP buckets (--bucket-mb), so the difference is whether the buckets'
all-reduces start during the backward (compile outside DDP: dynamo's DDPOptimizer splits the graph at bucket
boundaries) or only after it (compile inside DDP). Median [min, max] ms per step after warm-up (compilation
excluded); variants interleaved.
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import subprocess
import sys
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

VARIANTS = ("eager DDP", "compile inside DDP (old)", "DDP inside compile (new)")


def build(variant: str, device: torch.device, args: argparse.Namespace) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(*[m for _ in range(args.layers) for m in (nn.Linear(args.width, args.width), nn.GELU())])
    model = model.to(device)
    ids = [device.index] if device.type == "cuda" else None
    if variant == "compile inside DDP (old)":
        wrapped: nn.Module = DDP(torch.compile(model), device_ids=ids, bucket_cap_mb=args.bucket_mb)
    else:
        wrapped = DDP(model, device_ids=ids, bucket_cap_mb=args.bucket_mb)
        if variant == "DDP inside compile (new)":
            wrapped = torch.compile(wrapped)
    return wrapped, torch.optim.SGD(model.parameters(), lr=1e-4)


def timed_steps(model: nn.Module, optimizer: torch.optim.Optimizer, x: torch.Tensor, steps: int) -> float:
    sync = torch.cuda.synchronize if x.is_cuda else (lambda: None)
    dist.barrier()
    sync()
    started = time.perf_counter()
    for _ in range(steps):
        model(x).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    sync()
    return (time.perf_counter() - started) * 1000 / steps


def worker(args: argparse.Namespace) -> None:
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ["LOCAL_RANK"])
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", local_rank % torch.cuda.device_count()) if cuda else torch.device("cpu")
    own_gpu = cuda and torch.cuda.device_count() >= int(os.environ["LOCAL_WORLD_SIZE"])
    backend = "nccl" if own_gpu else "gloo"
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=1200))
    x = torch.randn(args.batch, args.width, device=device)
    models = {v: build(v, device, args) for v in VARIANTS}
    for model, optimizer in models.values():
        timed_steps(model, optimizer, x, 5)  # compile and warm up
    times: dict[str, list[float]] = {v: [] for v in VARIANTS}
    for r in range(args.repeats):
        for v in VARIANTS[r % 3:] + VARIANTS[:r % 3]:
            times[v].append(timed_steps(*models[v], x, args.steps))
    if rank == 0:
        report(times, device, backend, world, args)
    dist.destroy_process_group()


def report(times: dict[str, list[float]], device: torch.device, backend: str, world: int, args) -> None:
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"# compile order: {name}, torch {torch.__version__}, CUDA {torch.version.cuda}, {world} processes, "
          f"{backend}, {datetime.date.today()}; {args.layers} x Linear({args.width}), batch {args.batch}, "
          f"buckets {args.bucket_mb} MB, {args.steps} steps x {args.repeats}")
    base = statistics.median(times[VARIANTS[0]])
    print(f"| {'variant':<26} | {'ms/step median [min, max]':<27} | {'vs eager':>8} |")
    print(f"|{'-' * 28}|{'-' * 29}|{'-' * 10}|")
    for v, ts in times.items():
        med = statistics.median(ts)
        print(f"| {v:<26} | {f'{med:.2f} [{min(ts):.2f}, {max(ts):.2f}]':<27} | {med / base:>7.3f}x |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--bucket-mb", type=float, default=4.0, help="at least 1: DDP's first bucket is 1 MB, and dynamo's DDPOptimizer requires the others to be no smaller")
    args = parser.parse_args()
    if "RANK" in os.environ:
        worker(args)
        return
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={args.nproc}",
           __file__, *sys.argv[1:]]
    sys.exit(subprocess.call(cmd))


if __name__ == "__main__":
    main()
