"""A plain torch DDP training script, as users write them: nothing of hpctrain in it. The script-job tests copy it
into their own folder and run it with `hpctrain train|slurm submit|sweep submit --script`.

torchrun's variables -> init_process_group; a DistributedSampler; DDP; its own torch.save checkpoint at the end of
every epoch (and, with --handle-signal, at the step where SIGUSR2 or SIGTERM came: every rank agrees on that step,
rank 0 saves, all exit 75). It records what the tests check in --out: each rank's host, world size, arguments and
HPCTRAIN_SETTINGS (ranks/), each signal a rank received (signals/), its progress, the final weights.

It ends with os._exit after flushing, as a script on gloo must to be sure of its exit code: a torch thread still
alive while the interpreter finalizes aborts the process (SIGABRT, "terminate called without an active
exception", pytorch/pytorch#38228), which made a finished run and a 75 into failures here.
"""

import argparse
import json
import os
import signal
import socket
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

parser = argparse.ArgumentParser()
parser.add_argument("--out", required=True, help="checkpoint and records folder")
parser.add_argument("--epochs", type=int, default=3)
parser.add_argument("--lr", type=float, default=0.05)
parser.add_argument("--handle-signal", action="store_true", help="on SIGUSR2/SIGTERM: save and exit 75")
parser.add_argument("--fail-rank", type=int, default=-1, help="this rank raises at its third step")
parser.add_argument("--step-sleep", type=float, default=0.0, help="seconds per step, so a signal lands mid-run")
parser.add_argument("--metrics", default="", help="also write hpctrain-format records to this metrics.jsonl")
args = parser.parse_args()

dist.init_process_group("gloo")  # RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT from torchrun
rank, world = dist.get_rank(), dist.get_world_size()
out = Path(args.out)
for sub in ("ranks", "signals"):
    (out / sub).mkdir(parents=True, exist_ok=True)
(out / "ranks" / f"rank{rank}.json").write_text(json.dumps({
    "rank": rank, "world": world, "host": socket.gethostname(), "argv": sys.argv[1:],
    "settings": os.environ.get("HPCTRAIN_SETTINGS", ""), "restart": os.environ.get("SLURM_RESTART_COUNT", "")}))

stop = []
if args.handle_signal:
    def on_signal(signum, _frame):
        stop.append(signum)
        with open(out / "signals" / f"rank{rank}.txt", "a") as f:
            f.write(f"{signal.Signals(signum).name} {socket.gethostname()} {os.getpid()}\n")

    for sig in (signal.SIGUSR2, signal.SIGTERM):
        signal.signal(sig, on_signal)

gen = torch.Generator().manual_seed(0)
x = torch.randn(512, 8, generator=gen)
y = x @ torch.randn(8, 1, generator=gen) + 0.1 * torch.randn(512, 1, generator=gen)
data = TensorDataset(x, y)
sampler = DistributedSampler(data, num_replicas=world, rank=rank, shuffle=True, seed=0)
loader = DataLoader(data, batch_size=16, sampler=sampler)
torch.manual_seed(0)
model = DistributedDataParallel(torch.nn.Linear(8, 1, bias=False))
optimizer = torch.optim.SGD(model.parameters(), lr=args.lr)

checkpoint = out / "checkpoint.pt"
epoch, skip = 0, 0
if checkpoint.exists():
    state = torch.load(checkpoint)
    model.module.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    epoch, skip = state["epoch"], state["batch"]
    print(f"rank {rank}: resumed from {checkpoint} at epoch {epoch}, batch {skip}", flush=True)


def finish(code: int) -> None:
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def save(epoch: int, batch: int) -> None:
    if rank == 0:
        state = {"model": model.module.state_dict(), "optimizer": optimizer.state_dict(), "epoch": epoch,
                 "batch": batch}
        torch.save(state, f"{checkpoint}.tmp")
        os.replace(f"{checkpoint}.tmp", checkpoint)
    dist.barrier()


step = 0
while epoch < args.epochs:
    sampler.set_epoch(epoch)
    total = torch.zeros(2)
    for batch, (xb, yb) in enumerate(loader):
        if batch < skip:
            continue
        flag = torch.tensor([1.0 if stop else 0.0])
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)  # every rank stops at the same step
        if flag.item():
            save(epoch, batch)
            print(f"rank {rank}: stopped by a signal at epoch {epoch}, batch {batch}; saved", flush=True)
            finish(75)
        step += 1
        if rank == args.fail_rank and step == 3:
            raise RuntimeError(f"boom on rank {rank}")
        loss = torch.nn.functional.mse_loss(model(xb), yb)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        total += torch.tensor([loss.item() * len(xb), len(xb)])
        if rank == 0:
            (out / "progress.txt").write_text(f"{epoch} {batch}\n")
        time.sleep(args.step_sleep)
    skip = 0
    epoch += 1
    save(epoch, 0)
    dist.all_reduce(total)
    if rank == 0:
        print(f"epoch {epoch} loss={total[0].item() / total[1].item():.6f}", flush=True)
        if args.metrics:
            with open(args.metrics, "a") as f:
                f.write(json.dumps({"step": epoch, "split": "train", "loss": total[0].item() / total[1].item()}) + "\n")

if rank == 0:
    torch.save(model.module.state_dict(), out / "final.pt")
dist.destroy_process_group()
finish(0)
