"""What the host dispatches per optimizer step in each step mode, counted on the CPU: the aten operators of one
step of hpctrain's own step (train/step.py) on the DDPM reference U-Net. Prints a table.

    python benchmarks/step_ops.py [--compile] [--micro 2] [--smoke] [--json PATH]

On a GPU most operators that are not views launch one or more kernels (allocations such as empty_strided do not),
each at some microseconds of host time: the count is what a host-bound step pays for, and it does not depend on the
batch, so it is counted here, where no GPU is, at a small micro batch. Counted below autograd with a
TorchDispatchMode (so the backward's operators are in, and composite operators appear as what they decompose into),
over one whole call of the step (the batch cut from the on-device data, forward, backward, clipping, the fused
AdamW, the scheduler, the EMA), after warm-up steps. bf16 autocast on the CPU stands in for the GPU's (its cast
lists are close, not equal).

Rows:
  eager           the reference config (channels_last): what the GPU host launches today without capture.
  eager NCHW      train.channels_last=false. The CPU's kernels support other layouts than the GPU's (its
                  GroupNorm has a channels_last kernel, CUDA's has none), so this row shows the CPU's conversions.
  compiled        train.step_mode=compiled (--compile; minutes of compilation on the CPU). Dynamo runs a frame
                  eagerly while a TorchDispatchMode is active, so this row is counted another way, in a second
                  table with eager beside it counted the same way: torch.profiler's leaf events of the step (an
                  event with no operator inside it: what does the work), less those that launch nothing on a GPU
                  (allocation, views, metadata), with Inductor's generated kernels named by its kernel profiling.
  graphed, host   train.step_mode=graphed's work on the host per step: the batch and draw copies into the static
                  slots, the learning rates into their device tensors, and one graph launch; the captured step is
                  counted once at its capture (the "in the graph" column), and a replay launches all of it at once.
                  On the CPU no graph can be captured: a stand-in runs the body at capture and nothing at replay.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import datetime
import json
import sys
import tempfile
from pathlib import Path
from typing import Any
from unittest import mock

import torch
from torch.utils._python_dispatch import TorchDispatchMode

SMOKE = ("model.image_size=16", "model.ch=16", "model.ch_mult=[1, 2]", "model.num_res_blocks=1",
         "model.attn_resolutions=[8]", "model.norm_groups=8")


class OpCounter(TorchDispatchMode):
    """Every aten operator that reaches the dispatcher below autograd, by name."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: collections.Counter = collections.Counter()
        self.views = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[func.overloadpacket.__name__] += 1
        self.views += bool(func.is_view)
        return func(*args, **(kwargs or {}))

    def summary(self) -> dict[str, Any]:
        total = sum(self.ops.values())
        copies = sum(n for name, n in self.ops.items() if name in ("copy_", "_to_copy", "clone", "contiguous"))
        return {"ops": total, "views": self.views, "launching": total - self.views, "copies": copies,
                "top": self.ops.most_common(6), "counts": dict(self.ops)}


class StandInGraph:
    """CudaGraph's interface without CUDA: capture runs the body once under the counter (what the graph would hold),
    replay launches nothing (what the host does per replay is counted around it)."""

    side_stream = staticmethod(lambda owner: contextlib.nullcontext())

    @staticmethod
    def event() -> Any:
        return type("Done", (), {"synchronize": lambda self: None})()

    def capture(self, body) -> None:
        with OpCounter() as counter:
            body()
        self.captured = counter.summary()

    def replay(self) -> None:
        pass


def context(mode: str, micro: int, smoke: bool, run_dir: str, extra: tuple[str, ...] = ()):
    from hpctrain.dist.runtime import single_process_runtime
    from hpctrain.train import optim, run
    from hpctrain.resolution import resolve_config as resolve
    from hpctrain.train.graphed import GraphedStep

    channels_last = "false" if mode == "eager-nchw" else "true"
    overrides = ["model.source=fixture", "model.fixture_samples=64", "data.on_device=true", "data.num_workers=0",
                 "train.precision=bf16", f"train.channels_last={channels_last}",
                 f"train.step_mode={'compiled' if mode == 'compiled' else 'eager'}",
                 f"train.global_batch_size={micro}", f"train.micro_batch_size={micro}", "train.max_steps=1000",
                 "log.progress=off", "log.tensorboard=false", f"run.dir={run_dir}", *(SMOKE if smoke else ()), *extra]
    cls, cfg = resolve("ddpm_cifar10", None, tuple(overrides))
    build = optim.build_optimizer
    # The fused optimizer, as a GPU run builds it (on the CPU hpctrain builds the foreach one).
    with mock.patch.object(optim, "build_optimizer", lambda *a, **k: build(*a, **(k | {"fused": True}))):
        ctx = run.build_context(cfg, single_process_runtime(torch.device("cpu")), cls(cfg), config_text="",
                                write_run_dir=False, pretrained=False)
    if mode == "graphed":
        ctx.stepper = GraphedStep(warmup=1, graph_class=StandInGraph)
    return ctx


def step_under(around: contextlib.AbstractContextManager, mode: str, micro: int, smoke: bool, warmup: int,
               extra: tuple[str, ...] = ()) -> Any:
    """One step of hpctrain's own stepper inside ``around`` (a counter, a profiler), after ``warmup`` steps (graphed:
    and its eager step and capture); ``extra``: config overrides. Returns the captured graph (graphed), else None."""
    from hpctrain.train import loop

    with tempfile.TemporaryDirectory() as run_dir:
        ctx = context(mode, micro, smoke, run_dir, extra)
        ctx.sampler.set_position(0, 0)
        batches = iter(ctx.train_loader)

        def step() -> None:
            ctx.stepper(ctx, batches, loop._Window(ctx.state.step))
            ctx.state.advance(ctx.batches.global_batch_size, ctx.sampler.steps_per_epoch)

        for _ in range(warmup + (2 if mode == "graphed" else 0)):
            step()
        with around:
            step()
        return getattr(ctx.stepper, "graph", None)


def count_step(mode: str, micro: int, smoke: bool, warmup: int, extra: tuple[str, ...] = ()) -> dict[str, Any]:
    """The operators of the step, counted below autograd."""
    counter = OpCounter()
    graph = step_under(counter, mode, micro, smoke, warmup, extra)
    out = counter.summary()
    if graph is not None:
        out["in_graph"] = graph.captured["launching"]
        out["graph_launches"] = 1
    return out


NO_LAUNCH = {"aten::empty", "aten::empty_strided", "aten::as_strided", "aten::as_strided_", "aten::resize_",
             "detach", "aten::detach", "aten::view", "aten::resolve_conj", "aten::resolve_neg", "aten::_local_scalar_dense",
             "aten::set_", "aten::alias", "aten::lift_fresh", "aten::_reshape_alias", "aten::unsqueeze", "aten::squeeze",
             "aten::permute", "aten::t", "aten::transpose", "aten::expand", "aten::slice", "aten::select", "aten::to"}
"""Leaf events that allocate or describe memory (a leaf aten::to changed nothing): no kernel on a GPU."""
WHOLE = ("aten::_foreach_", "aten::_fused_")
"""Events counted as one launch with what is inside them: on the CPU a foreach operator loops over its tensors
(an event per tensor inside it); on a GPU it is one multi-tensor kernel per launch of up to a few hundred tensors."""


def launches(event) -> list[str]:
    """The names of what ``event`` would launch on a GPU."""
    if event.name.startswith(WHOLE):
        return [event.name]
    if not event.cpu_children:
        return [] if event.name in NO_LAUNCH else [event.name]
    return [name for child in event.cpu_children for name in launches(child)]


def profile_step(mode: str, micro: int, smoke: bool, warmup: int) -> dict[str, Any]:
    """The step's profiler leaves that would launch a kernel on a GPU (compiled: Inductor's kernels among them)."""
    import torch._inductor.config as inductor
    from torch.profiler import ProfilerActivity, profile

    inductor.cpp.enable_kernel_profile = True  # each generated C++ kernel becomes a profiler event
    prof = profile(activities=[ProfilerActivity.CPU])
    step_under(prof, mode, micro, smoke, warmup)
    leaves = [name for e in prof.events() if e.cpu_parent is None for name in launches(e)]
    kernels = [n for n in leaves if "cpp_fused" in n]
    return {"launching": len(leaves), "inductor_kernels": len(kernels), "aten": len(leaves) - len(kernels),
            "top": collections.Counter(leaves).most_common(4)}


ROWS = {"eager": "eager (channels_last)", "eager-nchw": "eager NCHW", "compiled": "compiled",
        "graphed": "graphed, host per replay"}


def render(results: dict[str, dict[str, Any]], head: list[str]) -> str:
    lines = head + ["", "| step | aten ops | of them views | not views | copies | in the graph (not views) | "
                        "most frequent |", "|---|---:|---:|---:|---:|---:|---|"]
    for mode, r in results.items():
        graph = f"{r['in_graph']:,} (1 launch)" if "in_graph" in r else ""
        top = ", ".join(f"{name} {n}" for name, n in r["top"][:4])
        lines.append(f"| {ROWS[mode]} | {r['ops']:,} | {r['views']:,} | {r['launching']:,} | {r['copies']:,} | "
                     f"{graph} | {top} |")
    return "\n".join(lines)


def render_profiled(results: dict[str, dict[str, Any]]) -> str:
    lines = ["", "Counted by torch.profiler (leaf events that launch work; see the docstring):", "",
             "| step | launching events | Inductor kernels | aten operators | most frequent |", "|---|---:|---:|---:|---|"]
    for mode, r in results.items():
        top = ", ".join(f"{name} {n}" for name, n in r["top"])
        lines.append(f"| {ROWS[mode]} | {r['launching']:,} | {r['inductor_kernels']:,} | {r['aten']:,} | {top} |")
    return "\n".join(lines)


def header(args: argparse.Namespace) -> list[str]:
    model = "the smoke-test U-Net" if args.smoke else "the DDPM reference U-Net (35.7M parameters, 32x32)"
    from hpctrain.provenance import cpu_model

    return [f"step_ops: {model}, micro batch {args.micro}, bf16 autocast, fused AdamW, EMA, grad clip; "
            f"torch {torch.__version__}, {cpu_model()}, "
            f"{datetime.date.today().isoformat()}"]


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--micro", type=int, default=2, help="micro batch (the counts do not depend on it)")
    p.add_argument("--warmup", type=int, default=2, help="steps before the counted one")
    p.add_argument("--compile", action="store_true", help="also the compiled row (minutes of compilation)")
    p.add_argument("--smoke", action="store_true", help="the small U-Net of the tests")
    p.add_argument("--json", default="", metavar="PATH", help="also write the numbers as JSON")
    return p


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parser().parse_args(argv)
    torch.manual_seed(0)
    results = {mode: count_step(mode, args.micro, args.smoke, args.warmup) for mode in ("eager", "eager-nchw", "graphed")}
    text = render(results, header(args))
    if args.compile:
        profiled = {mode: profile_step(mode, args.micro, args.smoke, args.warmup) for mode in ("eager", "compiled")}
        results["profiled"] = profiled
        text += "\n" + render_profiled(profiled)
    print(text)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return results


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    main()
