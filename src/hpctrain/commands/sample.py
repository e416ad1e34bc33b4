"""`hpctrain sample RUN_DIR`: a trained run's outputs (its experiment's outputs hook: a grid of samples) drawn
again from a checkpoint, on 1 or N processes, into a folder of PNGs (worker side: train/sampling.py).

The run's own config.toml says which experiment and which options; key=value overrides go on top (--n and
--ddim-steps are model.samples and model.sample_steps). Rank 0 writes the PNGs under --out (default
RUN_DIR/samples) and prints their paths; nothing else is written into RUN_DIR.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from hpctrain.commands.arguments import check_nproc
from hpctrain.errors import UserError

if TYPE_CHECKING:  # torch: `hpctrain --help` builds every command's parser without it
    from hpctrain.config.schema import RunConfig
    from hpctrain.dist.runtime import Runtime
    from hpctrain.experiments import Experiment

# What a sampling worker imports before drawing: imported once in the launcher when the workers are its forks.
PRELOAD = ("torch.distributed.checkpoint", "hpctrain.checkpoint.manager", "hpctrain.train.sampling")


def add_parser(sub) -> None:
    sample = sub.add_parser(
        "sample", help="draw a trained run's samples (its outputs hook) from a checkpoint into PNGs",
        description="Loads RUN_DIR/config.toml (key=value overrides on top) and the checkpoint's weights (the EMA ones "
        "when present), runs the experiment's outputs hook split across the processes, writes the PNGs under --out "
        "and prints their paths. Writes nothing else into RUN_DIR.",
    )
    sample.add_argument("run_dir", metavar="RUN_DIR", help="the run directory of a trained run")
    sample.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides, e.g. run.seed=1")
    sample.add_argument("--n", type=int, metavar="N", help="samples to draw (model.samples)")
    sample.add_argument("--ddim-steps", type=int, metavar="K", help="DDIM steps (model.sample_steps); 0: ancestral")
    sample.add_argument("--out", default="", metavar="DIR", help="where the PNGs go (default RUN_DIR/samples)")
    sample.add_argument("--nproc-per-node", type=int, default=0, metavar="N",
                        help="start N local processes through torchrun (ignored when already launched)")
    sample.add_argument("--resume", metavar="auto|PATH", help="the checkpoint: the latest (auto, the default) or a "
                        "checkpoint directory")
    sample.add_argument("--debug", action="store_true", help="show tracebacks")
    sample.set_defaults(run=run, command_name="sample")


@dataclass(frozen=True)
class SampleRequest:
    """`hpctrain sample RUN_DIR ...`, its flags as overrides (the form the torchrun workers receive)."""

    run_dir: Path
    """The trained run's directory (absolute)."""
    overrides: tuple[str, ...]
    """key=value items, --n, --ddim-steps and --resume among them."""
    nproc_per_node: int
    """--nproc-per-node; 0 when not given."""
    debug: bool
    """--debug."""
    out: Path
    """--out DIR (absolute; default RUN_DIR/samples)."""

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> "SampleRequest":
        from hpctrain.train.sampling import check_out_dir

        nproc = check_nproc(args.nproc_per_node)
        run_dir = Path(args.run_dir).resolve()
        out = Path(args.out).resolve() if args.out else run_dir / "samples"
        check_out_dir(out, run_dir)
        overrides = tuple(args.overrides) + sample_overrides(args.n, args.ddim_steps, args.resume)
        return cls(run_dir, overrides, nproc, args.debug, out)

    def module_args(self) -> list[str]:
        """The same request for the workers that torchrun starts (without --nproc-per-node)."""
        args = ["sample", str(self.run_dir), *self.overrides, "--out", str(self.out)]
        return args + (["--debug"] if self.debug else [])


def sample_overrides(n: int | None, ddim_steps: int | None, resume: str | None) -> tuple[str, ...]:
    """The command line's flags as key=value overrides (the form the torchrun workers receive)."""
    if n is not None and n < 1:
        raise UserError(f"--n must be at least 1, got {n}")
    if ddim_steps is not None and ddim_steps < 0:
        raise UserError(f"--ddim-steps must be 0 (ancestral sampling) or more, got {ddim_steps}")
    if resume == "never":
        raise UserError("--resume never loads no weights", "use --resume auto (the latest checkpoint) or a checkpoint "
                        "directory.")
    out: tuple[str, ...] = ()
    if n is not None:
        out += (f"model.samples={n}",)
    if ddim_steps is not None:
        out += (f"model.sample_steps={ddim_steps}",)
    if resume:
        out += (f"ckpt.resume={resume}",)
    return out


def run(args: argparse.Namespace) -> int:
    from hpctrain.commands.launching import run_on_processes
    from hpctrain.commands.train import preflight_read
    from hpctrain.resolution import resolve_sample

    req = SampleRequest.from_args(args)

    def draw_here(cls: type[Experiment], cfg: RunConfig, runtime: Runtime) -> int:
        from hpctrain.train.sampling import sample_here

        return sample_here(cfg, runtime, cls, str(req.out))

    # No alert config: sampling is not the run's training.
    return run_on_processes(req, lambda: resolve_sample(req.run_dir, req.overrides), preflight_read, draw_here,
                            alert=False, preload=PRELOAD)
