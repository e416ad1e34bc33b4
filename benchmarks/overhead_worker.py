"""One rank of the overhead benchmark's peers (run by torchrun): the same model, data and optimizer as
the hpctrain run, trained by a plain hand-written DDP loop, by Lightning Fabric, or by Accelerate.

    torchrun --nproc-per-node 2 benchmarks/overhead_worker.py plain|fabric|accelerate OUT.json

Rank 0 writes {"steps_per_s": ...} for the steps between WARMUP and WARMUP + MEASURED, timed between
two barriers, like the hpctrain run's log records at those steps (which follow a loss all-reduce).
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler

from overhead import LR, MEASURED, MICRO_BATCH, WARMUP, build_data, build_model


def batches(loader, sampler):
    epoch = 0
    while True:
        if hasattr(sampler, "set_epoch"):
            sampler.set_epoch(epoch)
        yield from loader
        epoch += 1


def timed(step_fn, data, barrier) -> float:
    it = iter(data)
    for _ in range(WARMUP):
        step_fn(*next(it))
    barrier()
    started = time.perf_counter()
    for _ in range(MEASURED):
        step_fn(*next(it))
    barrier()
    return MEASURED / (time.perf_counter() - started)


def plain() -> tuple[float, int]:
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(build_model())
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    ds = build_data()
    sampler = DistributedSampler(ds, seed=0, drop_last=True)
    loader = DataLoader(ds, batch_size=MICRO_BATCH, sampler=sampler, drop_last=True)

    def step(x, y):
        loss = F.cross_entropy(model(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()

    rate = timed(step, batches(loader, sampler), dist.barrier)
    rank = dist.get_rank()
    dist.destroy_process_group()
    return rate, rank


def fabric() -> tuple[float, int]:
    from lightning.fabric import Fabric

    # Under torchrun Fabric joins the launched processes instead of starting its own.
    f = Fabric(accelerator="cpu", strategy="ddp", devices=int(os.environ["LOCAL_WORLD_SIZE"]))
    f.launch()
    torch.manual_seed(0)
    model = build_model()
    model, opt = f.setup(model, torch.optim.AdamW(model.parameters(), lr=LR))
    loader = f.setup_dataloaders(DataLoader(build_data(), batch_size=MICRO_BATCH, shuffle=True, drop_last=True))

    def step(x, y):
        loss = F.cross_entropy(model(x), y)
        opt.zero_grad(set_to_none=True)
        f.backward(loss)
        opt.step()

    return timed(step, batches(loader, loader.sampler), f.barrier), f.global_rank


def accelerate() -> tuple[float, int]:
    from accelerate import Accelerator

    acc = Accelerator(cpu=True)
    torch.manual_seed(0)
    model = build_model()
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    loader = DataLoader(build_data(), batch_size=MICRO_BATCH, shuffle=True, drop_last=True)
    model, opt, loader = acc.prepare(model, opt, loader)

    def step(x, y):
        loss = F.cross_entropy(model(x), y)
        opt.zero_grad(set_to_none=True)
        acc.backward(loss)
        opt.step()

    def loop():
        epoch = 0
        while True:
            loader.set_epoch(epoch)
            yield from loader
            epoch += 1

    return timed(step, loop(), acc.wait_for_everyone), acc.process_index


def main() -> None:
    variant, out = sys.argv[1], Path(sys.argv[2])
    rate, rank = {"plain": plain, "fabric": fabric, "accelerate": accelerate}[variant]()
    if rank == 0:
        out.write_text(json.dumps({"steps_per_s": rate}))


if __name__ == "__main__":
    main()
