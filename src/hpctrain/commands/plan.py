"""`hpctrain plan EXPERIMENT --nodes N --gpus-per-node G`: measure one device's step (perf/step_profile.py) with
the run's own config, take the bus bandwidth (given, or from a `hpctrain doctor --perf` report), and print
perf/plan.py's estimate for N x G with its assumptions."""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING

from hpctrain.commands.arguments import add_run_args
from hpctrain.errors import UserError
from hpctrain.perf.plan import ClusterShape, StepProfile, advise, estimate, nearest_row
from hpctrain.perf.plan import __doc__ as MODEL_DOC

if TYPE_CHECKING:
    from hpctrain.config.schema import RunConfig


def add_parser(sub) -> None:
    plan = sub.add_parser("plan", help="estimate step time and scaling efficiency on N nodes x G GPUs from one "
                          "device's measured step and the bus bandwidth")
    add_run_args(plan)
    plan.add_argument("--nodes", type=int, required=True, metavar="N", help="nodes of the planned job (estimates for 1..N)")
    plan.add_argument("--gpus-per-node", type=int, required=True, metavar="G", help="ranks per node")
    plan.add_argument("--busbw", type=float, default=0.0, metavar="GB/s",
                      help="all-reduce bus bandwidth between those ranks (nccl-tests' busbw)")
    plan.add_argument("--preflight", default="", metavar="PATH",
                      help="take the bandwidth from a 'hpctrain doctor --perf' report (preflight.json or its directory)")
    plan.add_argument("--steps", type=int, default=5, help="measured steps after two warm-up steps (default 5)")
    plan.add_argument("--json", action="store_true", help="print the estimate as JSON")
    plan.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from hpctrain.config import batch_sizes
    from hpctrain.perf.step_profile import measure_step
    from hpctrain.resolution import resolve_config

    if args.nodes < 1 or args.gpus_per_node < 1:
        raise UserError(f"--nodes and --gpus-per-node must be at least 1, got {args.nodes} and {args.gpus_per_node}")
    cls, cfg = resolve_config(args.experiment, args.config_file, tuple(args.overrides))
    from hpctrain.experiments.step_experiment import StepExperiment

    if isinstance(cls, type) and issubclass(cls, StepExperiment):
        raise UserError(f"hpctrain plan measures an Experiment's step (its train_loss); {cls.__name__} is a "
                        "StepExperiment, whose train_step hpctrain cannot time on its own",
                        "plan with an Experiment of the same model and batch, or time the run itself: hpctrain train "
                        "on one device for a few steps, then hpctrain report RUN_DIR.")
    n = args.nodes * args.gpus_per_node
    batches = batch_sizes(cfg.train.global_batch_size, cfg.train.micro_batch_size, n)  # bad arithmetic: told now
    busbw, source = bandwidth(args.busbw, args.preflight, cfg.dist.bucket_cap_mb * 2**20)
    profile, device = measure_step(cls, cfg, max(args.steps, 1))
    layout = ClusterShape(args.nodes, args.gpus_per_node, batches.grad_accum, cfg.dist.bucket_cap_mb * 2**20,
                          cfg.dist.grad_compression)
    single = estimate(profile, ClusterShape(1, 1, batches.grad_accum, layout.bucket_bytes), busbw)
    planned = estimate(profile, layout, busbw)
    advice = advise(profile, layout, busbw)
    if args.json:
        print(json.dumps({"profile": asdict(profile), "device": str(device), "busbw_gbps": busbw, "busbw_source": source,
                          "single": asdict(single), "estimate": asdict(planned),
                          "alternatives": [asdict(a) for a in advice.alternatives], "advice": advice.lines}, indent=1))
    else:
        print(render_plan(cfg, profile, str(device), busbw, source, single, planned, advice), end="")
    return 0


def bandwidth(busbw_gbps: float, preflight: str, bucket_bytes: int) -> tuple[float, str]:
    """The bus bandwidth and where it came from: --busbw, else the --preflight report's row nearest a bucket."""
    if busbw_gbps > 0:
        return busbw_gbps, "given (--busbw)"
    if not preflight:
        raise UserError(
            "the plan needs the bus bandwidth between the ranks you will use",
            "run 'hpctrain doctor --perf' as a job step across those nodes and pass --preflight RUN/preflight.json, "
            "or give --busbw GB/s (nccl-tests' busbw).",
        )
    path = Path(preflight)
    path = path / "preflight.json" if path.is_dir() else path
    try:
        report = json.loads(path.read_text())
        row = nearest_row(report["bandwidth"], bucket_bytes)
        return float(row["busbw_gbps"]), f"measured by doctor --perf ({path}, {report['world_size']} ranks, " \
                                         f"{row['bytes'] / 2**20:g} MiB messages)"
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise UserError(f"cannot read the bandwidth from '{path}': {err}",
                        "give the preflight.json written by 'hpctrain doctor --perf', or --busbw GB/s.") from None


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
