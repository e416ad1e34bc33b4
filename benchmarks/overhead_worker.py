"""One rank of the overhead benchmark's peers (run by torchrun): the same model, data and optimizer as
the hpctrain run, trained by a plain hand-written DDP loop, by Lightning Fabric, or by Accelerate; or by the
plain loop plus hpctrain's stop-signal vote (its own StepVote, cast and collected at every step boundary as
hpctrain's loop does), which tells the vote's share of hpctrain's per-step cost.

    torchrun --nproc-per-node 2 benchmarks/overhead_worker.py plain|plain+vote|fabric|accelerate mlp|tiny OUT.json

Rank 0 writes {"steps_per_s": ...} for the steps between warmup and warmup + measured, timed between
two barriers, like the hpctrain run's log records at those steps (which follow a loss all-reduce).
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler

from hpctrain.dist.env import detect_launch
from hpctrain.dist.runtime import Runtime
from hpctrain.fault.vote import StepVote
from overhead import LR, WORKLOADS, Workload, build_data, build_model, loss_fn


def batches(loader, sampler):
    epoch = 0
    while True:
        if hasattr(sampler, "set_epoch"):
            sampler.set_epoch(epoch)
        yield from loader
        epoch += 1


def timed(w: Workload, step_fn, data, barrier) -> float:
    it = iter(data)
    for _ in range(w.warmup):
        step_fn(*next(it))
    barrier()
    started = time.perf_counter()
    for _ in range(w.measured):
        step_fn(*next(it))
    barrier()
    return w.measured / (time.perf_counter() - started)


def plain(name: str, vote: bool = False) -> tuple[float, int]:
    w = WORKLOADS[name]
    dist.init_process_group("gloo")
    boundary = _vote_at_boundary() if vote else None
    torch.manual_seed(0)
    net = build_model(name)
    # One process: no DDP, as hpctrain (and any loop written for it) runs one.
    model = torch.nn.parallel.DistributedDataParallel(net) if dist.get_world_size() > 1 else net
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    ds = build_data(name)
    sampler = DistributedSampler(ds, seed=0, drop_last=True)
    loader = DataLoader(ds, batch_size=w.micro_batch, sampler=sampler, drop_last=True)

    def step(x, y):
        loss = loss_fn(name, model(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if boundary is not None:
            boundary()

    return timed(w, step, batches(loader, sampler), dist.barrier), dist.get_rank()


def _vote_at_boundary():
    """What hpctrain's loop does with its vote at each step boundary: collect the previous step's, cast this one's."""
    runtime = Runtime(**dataclasses.asdict(detect_launch()), device=torch.device("cpu"), backend="gloo")
    step_vote = StepVote(runtime)

    def boundary() -> None:
        step_vote.collect()
        step_vote.cast(0, False)

    return boundary


def fabric(name: str) -> tuple[float, int]:
    from lightning.fabric import Fabric

    w = WORKLOADS[name]
    # Under torchrun Fabric joins the launched processes instead of starting its own.
    devices = int(os.environ["LOCAL_WORLD_SIZE"])
    f = Fabric(accelerator="cpu", strategy="ddp" if devices > 1 else "auto", devices=devices)
    f.launch()
    torch.manual_seed(0)
    model = build_model(name)
    model, opt = f.setup(model, torch.optim.AdamW(model.parameters(), lr=LR))
    loader = f.setup_dataloaders(DataLoader(build_data(name), batch_size=w.micro_batch, shuffle=True, drop_last=True))

    def step(x, y):
        loss = loss_fn(name, model(x), y)
        opt.zero_grad(set_to_none=True)
        f.backward(loss)
        opt.step()

    return timed(w, step, batches(loader, loader.sampler), f.barrier), f.global_rank


def accelerate(name: str) -> tuple[float, int]:
    from accelerate import Accelerator

    w = WORKLOADS[name]
    acc = Accelerator(cpu=True)
    torch.manual_seed(0)
    model = build_model(name)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    loader = DataLoader(build_data(name), batch_size=w.micro_batch, shuffle=True, drop_last=True)
    model, opt, loader = acc.prepare(model, opt, loader)

    def step(x, y):
        loss = loss_fn(name, model(x), y)
        opt.zero_grad(set_to_none=True)
        acc.backward(loss)
        opt.step()

    def loop():
        epoch = 0
        while True:
            loader.set_epoch(epoch)
            yield from loader
            epoch += 1

    return timed(w, step, loop(), acc.wait_for_everyone), acc.process_index


def main() -> None:
    variant, name, out = sys.argv[1], sys.argv[2], Path(sys.argv[3])
    runs = {"plain": plain, "plain+vote": lambda n: plain(n, vote=True), "fabric": fabric, "accelerate": accelerate}
    rate, rank = runs[variant](name)
    if rank == 0:
        out.write_text(json.dumps({"steps_per_s": rate}))
    # Fabric and Accelerate leave their group to interpreter exit, where gloo can abort the process
    # ("terminate called without an active exception") and fail a finished run.
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
