"""Training stall per checkpoint save, synchronous vs asynchronous, and time to resume. Prints a table.

    python benchmarks/checkpoint.py [--repeats 5] [--dir DIR] [--device cpu|cuda]

On a GPU machine it runs on cuda by default (batch 128; the save copies device to host).

State: the DDPM U-Net of the reference experiment (35.7M parameters) with AdamW moments and EMA
weights, as hpctrain's Checkpointer saves it (torch.distributed.checkpoint files plus train.pt, rng.pt, ...;
sha256 and fsync included; async: DCP's async_save with its staging buffers kept across saves). One process;
the saves of the two modes are interleaved. For each save:

- stall: how long the save call held the training loop (sync: the whole write; async: the CPU copy);
- write: save call to checkpoint complete on disk (async: until settle() returns);
- steps during write: mean time of the training steps run while the background write was going on,
  against the same steps without a write (on a CPU machine the writer competes with training for cores).

Resume: Checkpointer.restore into a freshly built model, optimizer and EMA (pick + sha256 verification
of every file + DCP load + set_state_dict), i.e. until the first step can run. --dir should be on the
file system runs use (default: a temporary directory). Median [min, max].
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

from hpctrain.checkpoint.manager import Checkpointer
from hpctrain.config.schema import OptimSection
from hpctrain.dist.runtime import single_process_runtime
from hpctrain.experiments.ddpm.model import UNet
from hpctrain.train.ema import build_ema
from hpctrain.train.optim import build_optimizer, build_scheduler
from hpctrain.train.rng import capture_rng
from hpctrain.train.state import TrainState


def build(device: torch.device) -> dict:
    model = UNet().to(device)
    cfg = OptimSection(lr=2e-4, ema_decay=0.9999)
    optimizer = build_optimizer(model, cfg)
    return {"model": model, "optimizer": optimizer, "scheduler": build_scheduler(optimizer, cfg, 10_000),
            "scaler": torch.amp.GradScaler(device.type, enabled=False), "ema": build_ema(model, cfg.ema_decay)}


def step(stateful: dict, device: torch.device, batch: int) -> float:
    started = time.perf_counter()
    model = stateful["model"]
    x = torch.randn(batch, 3, 32, 32, device=device)
    t = torch.randint(0, 1000, (batch,), device=device)
    model(x, t).square().mean().backward()
    stateful["optimizer"].step()
    stateful["optimizer"].zero_grad(set_to_none=True)
    stateful["scheduler"].step()
    stateful["ema"].update_parameters(model)
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - started


def one_save(ckpt: Checkpointer, stateful: dict, at: int, device: torch.device, batch: int, steps: int) -> dict:
    started = time.perf_counter()
    ckpt.save(TrainState(step=at).to_dict(), stateful, capture_rng(device))
    stall = time.perf_counter() - started
    during = [step(stateful, device, batch) for _ in range(steps)]
    ckpt.settle()
    write = time.perf_counter() - started if ckpt.async_save else stall  # sync: on disk when save() returns
    return {"stall": stall, "write": write, "steps": statistics.mean(during)}


def fmt(values: list[float], scale: float = 1000.0) -> str:
    return f"{statistics.median(values) * scale:,.0f} [{min(values) * scale:,.0f}, {max(values) * scale:,.0f}]"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--dir", type=Path, default=None, help="where to write (default: a temporary directory)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--batch", type=int, default=0, help="images per training step (default: 2 on CPU, 128 on CUDA)")
    p.add_argument("--steps-during", type=int, default=2, help="training steps run while a background write goes on")
    args = p.parse_args()
    device = torch.device(args.device)
    batch = args.batch or (128 if device.type == "cuda" else 2)
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        rt, stateful = single_process_runtime(device), build(device)
        step(stateful, device, batch)  # warm-up: optimizer state exists from here
        baseline = [step(stateful, device, batch) for _ in range(args.steps_during)]
        runs: dict[str, list[dict]] = {"sync": [], "async": []}
        ckpts = {mode: Checkpointer(Path(tmp) / mode, "ddpm", rt, "", keep_last=2, async_save=mode == "async")
                 for mode in runs}
        for i in range(args.repeats):
            for mode in runs:  # interleaved, so drift of the machine hits both modes alike
                runs[mode].append(one_save(ckpts[mode], stateful, i + 1, device, batch, args.steps_during))
            baseline += [step(stateful, device, batch) for _ in range(args.steps_during)]
        newest = sorted((Path(tmp) / "sync" / "checkpoints").glob("step_*"))[-1]
        size = sum(f.stat().st_size for f in newest.rglob("*") if f.is_file())
        resume = []
        for _ in range(args.repeats):
            fresh = build(device)
            started = time.perf_counter()
            ckpts["sync"].restore("auto", fresh)
            if device.type == "cuda":
                torch.cuda.synchronize()
            resume.append(time.perf_counter() - started)
    params = sum(t.numel() for t in stateful["model"].parameters())
    name = f"{device} ({torch.cuda.get_device_name(device)}, CUDA {torch.version.cuda})" if device.type == "cuda" \
        else "cpu"
    print(f"\nDDPM U-Net {params / 1e6:.1f}M parameters + AdamW + EMA: checkpoint {size / 1e6:,.0f} MB; device {name}, "
          f"torch {torch.__version__}, batch {batch}; median [min, max] of {args.repeats}, ms\n")
    print("| mode | stall per save | save to complete on disk | training step during the write |")
    print("|---|---:|---:|---:|")
    for mode, rows in runs.items():
        print(f"| {mode} | {fmt([r['stall'] for r in rows])} | {fmt([r['write'] for r in rows])} | "
              f"{fmt([r['steps'] for r in rows])} |")
    print(f"| (no save) | | | {fmt(baseline)} |")
    ratio = statistics.median(r["stall"] for r in runs["async"]) / statistics.median(r["stall"] for r in runs["sync"])
    print(f"\nasync stall / sync stall: {ratio:.3f} (goal <= 0.1)")
    print(f"resume (pick, verify sha256, load, ready for the first step): {fmt(resume)} ms")


if __name__ == "__main__":
    main()
