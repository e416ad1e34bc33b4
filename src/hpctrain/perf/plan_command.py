"""`hpctrain plan EXPERIMENT --nodes N --gpus-per-node G`: measure one device's step, estimate N x G.

The step is measured with the run's own config and code path (hpctrain's context, loader, precision,
optimizer and EMA), one process, on this machine's device; the estimate is perf.plan's arithmetic.
"""

from __future__ import annotations

import itertools
import json
import math
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from hpctrain.config import batch_sizes
from hpctrain.config.schema import RunConfig
from hpctrain.dist.runtime import single_process_runtime
from hpctrain.errors import UserError
from hpctrain.perf.plan import ClusterShape, StepProfile, advise, estimate, nearest_row
from hpctrain.perf.plan import __doc__ as MODEL_DOC


@dataclass(frozen=True)
class PlanRequest:
    experiment: str
    config_file: str | None
    overrides: tuple[str, ...]
    nodes: int
    gpus_per_node: int
    busbw_gbps: float
    """Given bus bandwidth; 0: from --preflight."""
    preflight: str
    """A preflight.json (or its directory) from `hpctrain doctor --perf` across the planned nodes."""
    steps: int
    """Measured steps (after two warm-up steps)."""
    as_json: bool


def plan_command(req: PlanRequest) -> int:
    from hpctrain.train.entry import resolve

    if req.nodes < 1 or req.gpus_per_node < 1:
        raise UserError(f"--nodes and --gpus-per-node must be at least 1, got {req.nodes} and {req.gpus_per_node}")
    cls, cfg = resolve(req.experiment, req.config_file, req.overrides)
    n = req.nodes * req.gpus_per_node
    batches = batch_sizes(cfg.train.global_batch_size, cfg.train.micro_batch_size, n)  # bad arithmetic: told now
    busbw, source = bandwidth(req, cfg.dist.bucket_cap_mb * 2**20)
    profile, device = measure_step(cls, cfg, max(req.steps, 1))
    layout = ClusterShape(req.nodes, req.gpus_per_node, batches.grad_accum, cfg.dist.bucket_cap_mb * 2**20,
                    cfg.dist.grad_compression)
    single = estimate(profile, ClusterShape(1, 1, batches.grad_accum, layout.bucket_bytes), busbw)
    planned = estimate(profile, layout, busbw)
    advice = advise(profile, layout, busbw)
    if req.as_json:
        print(json.dumps({"profile": asdict(profile), "device": str(device), "busbw_gbps": busbw, "busbw_source": source,
                          "single": asdict(single), "estimate": asdict(planned),
                          "alternatives": [asdict(a) for a in advice.alternatives], "advice": advice.lines}, indent=1))
    else:
        print(render_plan(cfg, profile, str(device), busbw, source, single, planned, advice), end="")
    return 0


def bandwidth(req: PlanRequest, bucket_bytes: int) -> tuple[float, str]:
    if req.busbw_gbps > 0:
        return req.busbw_gbps, "given (--busbw)"
    if not req.preflight:
        raise UserError(
            "the plan needs the bus bandwidth between the ranks you will use",
            "run 'hpctrain doctor --perf' as a job step across those nodes and pass --preflight RUN/preflight.json, "
            "or give --busbw GB/s (nccl-tests' busbw).",
        )
    path = Path(req.preflight)
    path = path / "preflight.json" if path.is_dir() else path
    try:
        report = json.loads(path.read_text())
        row = nearest_row(report["bandwidth"], bucket_bytes)
        return float(row["busbw_gbps"]), f"measured by doctor --perf ({path}, {report['world_size']} ranks, " \
                                         f"{row['bytes'] / 2**20:g} MiB messages)"
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise UserError(f"cannot read the bandwidth from '{path}': {err}",
                        "give the preflight.json written by 'hpctrain doctor --perf', or --busbw GB/s.") from None


def measure_step(experiment_cls, cfg: RunConfig, steps: int) -> tuple[StepProfile, torch.device]:
    """Median forward, backward and optimizer times of this config's micro-batch on one device (an eager step)."""
    from hpctrain.train.memory_format import resolve_memory_format
    from hpctrain.train.run import build_context

    runtime = single_process_runtime()
    cfg, _ = resolve_memory_format(cfg, runtime, experiment_cls(cfg), "eager")
    ctx = build_context(cfg, runtime, experiment_cls(cfg), config_text="", write_run_dir=False, pretrained=False)
    batches = _endless(ctx)
    # two warm-up steps: allocator, autotuning, lazy optimizer state
    times = [_timed_step(ctx, next(batches)) for _ in range(steps + 2)]
    fwd, bwd, opt = (statistics.median(t[k] for t in times[2:]) for k in range(3))
    grad_bytes = sum(p.numel() * p.element_size() for p in ctx.raw_model.parameters() if p.requires_grad)
    return StepProfile(fwd, bwd, opt, grad_bytes, cfg.train.micro_batch_size), runtime.device


def _endless(ctx):
    """Micro-batches from the run's own loader, epoch after epoch (a tiny data set may end first)."""
    for epoch in itertools.count():
        ctx.sampler.set_position(epoch, 0)
        yield from ctx.train_loader


def _timed_step(ctx, host_batch) -> tuple[float, float, float]:
    from hpctrain.experiments.base import BatchInfo, call_train_loss
    from hpctrain.train.device import to_device
    from hpctrain.train.step import apply_gradients

    device = ctx.runtime.device
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    batch = to_device(host_batch, device, ctx.cfg.train.channels_last_on)
    sync()
    t0 = time.perf_counter()
    with ctx.precision.autocast():
        # One process measuring one micro-batch: the first position of the step's global batch.
        info = BatchInfo("train", ctx.state.step, 0, ctx.batches.global_batch_size, ctx.cfg.run.seed)
        loss = call_train_loss(ctx.experiment, ctx.model, batch, info)
    sync()
    t1 = time.perf_counter()
    ctx.scaler.scale(loss).backward()
    sync()
    t2 = time.perf_counter()
    apply_gradients(ctx)
    sync()
    return t1 - t0, t2 - t1, time.perf_counter() - t2


def render_plan(cfg: RunConfig, p: StepProfile, device: str, busbw: float, source: str, single, planned, advice) -> str:
    lay = planned.layout
    out = [
        f"# Scaling plan: {cfg.experiment} on {lay.nodes} node(s) x {lay.gpus_per_node} = {lay.world_size} ranks", "",
        f"Measured on {device}: micro batch {p.micro_batch}, forward {p.forward_s * 1e3:.1f} ms, backward "
        f"{p.backward_s * 1e3:.1f} ms, optimizer {p.optimizer_s * 1e3:.1f} ms; gradients {p.grad_bytes / 2**20:.1f} MiB "
        f"per step in {math.ceil(p.grad_bytes / lay.bucket_bytes)} bucket(s) of {lay.bucket_bytes / 2**20:g} MiB.",
        f"Bus bandwidth {busbw:g} GB/s, {source}. Global batch {cfg.train.global_batch_size} = micro "
        f"{p.micro_batch} x {lay.world_size} ranks x {lay.grad_accum} accumulation.", "",
        "| layout | compute (ms) | all-reduce (ms) | exposed (ms) | step (ms) | efficiency | samples/s |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    rows = [("1 device, same work per step", single), ("planned", planned)]
    rows += [(_describe(a.layout, lay), a) for a in advice.alternatives]
    for name, e in rows:
        out.append(f"| {name} | {e.compute_s * 1e3:.1f} | {e.comm_s * 1e3:.1f} | {e.exposed_comm_s * 1e3:.1f} | "
                   f"{e.step_s * 1e3:.1f} | {e.efficiency:.0%} | {e.samples_per_s:,.1f} |")
    out += [""] + [f"- {line}" for line in advice.lines or ["not communication-bound at this bandwidth."]]
    if device == "cpu":
        out.append("- the step was measured on a CPU: for a GPU plan run `hpctrain plan` on one GPU of the cluster.")
    assumptions = (MODEL_DOC or "")[(MODEL_DOC or "").index("- weak"):].rstrip().splitlines()
    out += ["", "Assumptions:", ""] + [f"  {line.strip()}" if not line.startswith("- ") else line for line in assumptions] + [""]
    return "\n".join(out)


def _describe(alt: ClusterShape, base: ClusterShape) -> str:
    if alt.compression != base.compression:
        return f"with {alt.compression} gradient compression"
    return f"{alt.grad_accum} micro-batches per step"
