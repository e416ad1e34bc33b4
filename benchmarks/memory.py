"""Per-rank memory of the model state (parameters + gradients + optimizer state) under dist.strategy ddp, zero1 and
fsdp, for 1, 2 and 4 processes, and step time relative to ddp. Prints a table.

    python benchmarks/memory.py [--params 100] [--worlds 1,2,4] [--steps 4] [--device cpu|cuda]

The model: a stack of residual MLP blocks (Linear d -> 4d -> d, as in a transformer's feed-forward), about
--params million parameters, trained with fp32 AdamW, wrapped by hpctrain's own code (dist/wrap.py: DDP,
ZeroRedundancyOptimizer, FSDP2 per block and at the root; train/optim.py), one process per rank with gloo on
127.0.0.1 (CPU) or NCCL (GPU), started through hpctrain's runtime (dist/runtime.py).

Per rank:
- between steps: the bytes of the tensors the rank holds, counted exactly (local shards of parameters, gradients,
  AdamW's moments and step counts): what each strategy divides;
- peak in a step: torch's own memory tracker (torch.distributed._tools: MemTracker, and FSDPMemTracker under fsdp,
  which knows FSDP's unsharded parameters and gradients and its all-gather and reduce-scatter buffers), by
  category, the highest each category reached during one training step. "model state" is parameters + gradients
  + optimizer state, sharded and unsharded; communication buffers, activations and temporaries are shown apart.
  On a GPU also torch.cuda.max_memory_allocated (everything, allocator view).

Goals (issue 16): fsdp's model-state peak within 15% of full state / world + one block (its parameters and
gradients, gathered); zero1 saves at least 40% of the optimizer state at 4 processes. On this CPU machine the
ranks share 2 cores: step times include that contention (ddp's too, so ratios compare within a world size).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import socket
import statistics
import sys
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

STRATEGIES = ("ddp", "zero1", "fsdp")


class Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.up = nn.Linear(d, 4 * d)
        self.down = nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(self.norm(x))))


class Stack(nn.Module):
    def __init__(self, d: int, depth: int) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(d) for _ in range(depth))
        self.head = nn.Linear(d, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def shape_for(million: float) -> tuple[int, int]:
    """(width, depth) with about ``million`` M parameters: 12 blocks of 8 d^2 + 7 d parameters."""
    depth = 12
    d = round((million * 1e6 / depth / 8) ** 0.5 / 64) * 64
    return d, depth


@dataclass(frozen=True)
class Measured:
    strategy: str
    world: int
    params: int
    block_bytes: int
    """Parameters of one block, fp32."""
    state_bytes: dict[str, int]
    """Between steps: params, grads, optimizer."""
    peaks: dict[str, int]
    """The tracker's peak per category during a step."""
    device_peak: int
    """GPU: torch.cuda.max_memory_allocated during the tracked step; 0 on the CPU."""
    step_s: float

    @property
    def model_state_peak(self) -> int:
        return sum(self.peaks.get(k, 0) for k in MODEL_STATE)

    @property
    def communication_peak(self) -> int:
        return sum(self.peaks.get(k, 0) for k in COMMUNICATION)


def local_bytes(tensors) -> int:
    total = 0
    for t in tensors:
        if t is None:
            continue
        t = t.to_local() if hasattr(t, "to_local") else t
        total += t.numel() * t.element_size()
    return total


def optimizer_tensors(optimizer: torch.optim.Optimizer):
    inner = getattr(optimizer, "optim", optimizer)  # ZeroRedundancyOptimizer holds its partition's in .optim
    for state in inner.state.values():
        yield from (v for v in state.values() if isinstance(v, torch.Tensor))


MODEL_STATE = ("PARAM", "SHARDED_PARAM", "UNSHARDED_PARAM", "GRAD", "SHARDED_GRAD", "UNSHARDED_GRAD", "OPT")
COMMUNICATION = ("ALL_GATHER", "REDUCE_SCATTER")


def tracked_peak(step, model: nn.Module, optimizer, x: torch.Tensor, fsdp: bool) -> dict[str, int]:
    """Run one step under torch's memory tracker; the peak bytes of each category on the model's device."""
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
    from torch.distributed._tools.mem_tracker import MemTracker

    if fsdp:
        tracker = FSDPMemTracker(model, getattr(optimizer, "optim", optimizer))
        tracker.track_inputs((x,))
    else:
        tracker = MemTracker()
        tracker.track_external(model, optimizer)
    with tracker:
        step()
    peaks = next(iter(tracker.get_tracker_snapshot("peak").values()))
    return {str(k).rsplit(".", 1)[-1]: int(v) for k, v in peaks.items()}


def build(strategy: str, model: nn.Module, runtime, blocks: list[nn.Module]):
    """The model and optimizer exactly as hpctrain's training builds them for ``strategy`` (dist/wrap.py,
    train/optim.py), from the config keys a user sets."""
    from hpctrain.dist.wrap import unwrap_model, wrap_model
    from hpctrain.resolution import resolve_config as resolve
    from hpctrain.train.optim import build_optimizer

    _, cfg = resolve("digits", None, (f"dist.strategy={strategy}", "optim.name=adamw", "optim.weight_decay=0.0"))
    wrapped = wrap_model(model, cfg, runtime, blocks=blocks)
    optimizer = build_optimizer(unwrap_model(wrapped), cfg.optim, fused=runtime.device.type == "cuda",
                                zero=strategy == "zero1" and runtime.distributed)
    return wrapped, optimizer


def worker(rank: int, world: int, port: int, args, strategy: str, queue) -> None:
    from hpctrain.config.schema import DistSection
    from hpctrain.dist.env import detect_launch
    from hpctrain.dist.runtime import distributed_session, single_process_runtime

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world), GROUP_RANK="0", ROLE_RANK=str(rank),
                      ROLE_WORLD_SIZE=str(world), TORCHELASTIC_RUN_ID="memory-benchmark")
    torch.set_num_threads(1)
    with contextlib.ExitStack() as stack:
        if world > 1:
            runtime = stack.enter_context(distributed_session(detect_launch(), DistSection()))
        else:
            runtime = single_process_runtime(torch.device("cuda" if args.device == "cuda" else "cpu"))
        device = runtime.device
        d, depth = shape_for(args.params)
        torch.manual_seed(0)
        model = Stack(d, depth)
        params = sum(p.numel() for p in model.parameters())
        block_bytes = sum(p.numel() * 4 for p in model.blocks[0].parameters())
        wrapped, optimizer = build(strategy, model, runtime, list(model.blocks))
        x = torch.randn(args.batch, d, device=device)

        def step() -> tuple[float, int]:
            started = time.perf_counter()
            wrapped(x).square().mean().backward()
            optimizer.step()
            grads = local_bytes(p.grad for p in wrapped.parameters())
            optimizer.zero_grad(set_to_none=False)  # keep the gradients allocated: they are part of the state
            if device.type == "cuda":
                torch.cuda.synchronize()
            if world > 1:
                dist.barrier()
            return time.perf_counter() - started, grads

        step()  # warm-up: the optimizer state and the gradients are allocated in the first step
        times, grad_bytes = [], 0
        for _ in range(args.steps):
            seconds, grad_bytes = step()
            times.append(seconds)
        state = {"params": local_bytes(wrapped.parameters()), "grads": grad_bytes,
                 "optimizer": local_bytes(optimizer_tensors(optimizer))}
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        peaks = tracked_peak(step, wrapped, optimizer, x, fsdp=strategy == "fsdp" and world > 1)
        device_peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else 0
        if rank == 0:
            queue.put(Measured(strategy, world, params, block_bytes, state, peaks, device_peak,
                               statistics.median(times)))


def measure(strategy: str, world: int, args) -> Measured:
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.start_processes(worker, args=(world, port, args, strategy, queue), nprocs=world, join=True, start_method="spawn")
    return queue.get()


def table(results: list[Measured]) -> str:
    mb = 1e6
    gpu = any(r.device_peak for r in results)
    rows = ["| strategy | ranks | between steps: params + grads + optimizer (MB) | vs ddp | peak in a step: model "
            "state (MB) | bound: full / ranks + one block (MB) | peak / bound | communication buffers (MB) | "
            + ("GPU max allocated (MB) | " if gpu else "") + "step time vs ddp |",
            "|---|---|---|---|---|---|---|---|" + ("---|" if gpu else "") + "---|"]
    ddp = {r.world: r for r in results if r.strategy == "ddp"}
    for r in results:
        state = sum(r.state_bytes.values())
        full = sum(ddp[r.world].state_bytes.values()) if r.world in ddp else state
        bound = full / r.world + 2 * r.block_bytes  # a gathered block: its parameters and their gradients
        parts = " + ".join(f"{r.state_bytes[k] / mb:,.0f}" for k in ("params", "grads", "optimizer"))
        ratio = r.step_s / ddp[r.world].step_s if r.world in ddp else float("nan")
        rows.append(f"| {r.strategy} | {r.world} | {parts} = {state / mb:,.0f} | {state / full:.2f} | "
                    f"{r.model_state_peak / mb:,.0f} | {bound / mb:,.0f} | {r.model_state_peak / bound:.2f} | "
                    f"{r.communication_peak / mb:,.0f} | " + (f"{r.device_peak / mb:,.0f} | " if gpu else "")
                    + f"{ratio:.2f} |")
    return "\n".join(rows)


def goals(results: list[Measured]) -> list[str]:
    out = []
    by = {(r.strategy, r.world): r for r in results}
    for (strategy, world), r in sorted(by.items()):
        if strategy == "fsdp" and world > 1 and ("ddp", world) in by:
            full = sum(by[("ddp", world)].state_bytes.values())
            bound = full / world + 2 * r.block_bytes
            out.append(f"fsdp, {world} ranks: model-state peak {r.model_state_peak / 1e6:,.0f} MB vs full / ranks + "
                       f"one block {bound / 1e6:,.0f} MB ({(r.model_state_peak / bound - 1) * 100:+.0f}%; goal <= "
                       f"+15%): {'met' if r.model_state_peak <= 1.15 * bound else 'NOT met'}")
    for world in sorted({w for s, w in by if s == "zero1"}):
        if world > 1 and ("ddp", world) in by:
            saved = 1 - by[("zero1", world)].state_bytes["optimizer"] / by[("ddp", world)].state_bytes["optimizer"]
            goal = f" (goal at 4 ranks >= 40%): {'met' if saved >= 0.4 else 'NOT met'}" if world == 4 else ""
            out.append(f"zero1, {world} ranks: optimizer state {saved * 100:.0f}% smaller than ddp's{goal}")
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params", type=float, default=100, help="model size in millions of parameters")
    parser.add_argument("--worlds", default="1,2,4", help="numbers of processes")
    parser.add_argument("--strategies", default=",".join(STRATEGIES))
    parser.add_argument("--steps", type=int, default=4, help="timed steps after one warm-up step")
    parser.add_argument("--batch", type=int, default=8, help="rows per rank and step (activations stay small)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=["cpu", "cuda"])
    args = parser.parse_args(argv)
    worlds = [int(w) for w in args.worlds.split(",")]
    if args.device == "cuda" and max(worlds) > torch.cuda.device_count():
        worlds = [w for w in worlds if w <= torch.cuda.device_count()]
        print(f"only {torch.cuda.device_count()} GPU(s): worlds {worlds}", file=sys.stderr)
    results = []
    for world in worlds:
        for strategy in args.strategies.split(","):
            print(f"measuring {strategy} on {world} process(es) ...", file=sys.stderr, flush=True)
            results.append(measure(strategy, world, args))
    d, depth = shape_for(args.params)
    print(f"model: {depth} residual MLP blocks of width {d}, {results[0].params / 1e6:.1f} M parameters, fp32 AdamW; "
          f"device {args.device}; one block {results[0].block_bytes / 1e6:.1f} MB of parameters")
    print(table(results))
    for line in goals(results):
        print(line)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
