"""Arguments that several commands share: an experiment's config sources, and the local launch flags."""

from __future__ import annotations

import argparse
import sys
from typing import Sequence

from hpctrain.errors import UserError


def add_run_args(p: argparse.ArgumentParser, optional: bool = False) -> None:
    """EXPERIMENT [key=value ...] [--config FILE] [--debug]: the sources of a config (resolution.resolve_config).
    ``optional``: EXPERIMENT may be left out (a command that takes --script or --module instead)."""
    p.add_argument("experiment", nargs="?" if optional else None, default="",
                   help="built-in experiment name (see 'hpctrain experiments') or package.module:Class")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides, e.g. train.max_steps=200")
    p.add_argument("--config", dest="config_file", metavar="FILE", help="TOML config file (below key=value overrides)")
    p.add_argument("--debug", action="store_true", help="show tracebacks")


def add_launch_args(p: argparse.ArgumentParser) -> None:
    """--nproc-per-node and --resume, for the commands that train or evaluate."""
    p.add_argument(
        "--nproc-per-node", type=int, default=0, metavar="N",
        help="start N local processes through torchrun (ignored when already launched by torchrun or srun)",
    )
    p.add_argument(
        "--resume", metavar="auto|never|PATH",
        help="shortcut for ckpt.resume=...: continue from the run dir's latest checkpoint (auto, the default), "
        "refuse a run dir with checkpoints (never), or start from a checkpoint directory",
    )


def check_nproc(nproc_per_node: int) -> int:
    """--nproc-per-node as given (0: not given), or a UserError for a negative one."""
    if nproc_per_node < 0:
        raise UserError(f"--nproc-per-node must be positive, got {nproc_per_node}")
    return nproc_per_node


def add_script_args(p: argparse.ArgumentParser, nproc: bool = True) -> None:
    """--script PATH | --module MODULE, and the script's arguments after ``--`` (args.script_args): a command that
    can run a torchrun script of the user's instead of an experiment. ``nproc``: --nproc-per-node too."""
    target = p.add_mutually_exclusive_group()
    target.add_argument("--script", metavar="PATH",
                        help="run your own torchrun script instead of an experiment (its arguments after --); a "
                        "positional EXPERIMENT that ends in .py and names a file means the same")
    target.add_argument("--module", metavar="MODULE", help="the same for python -m MODULE")
    if nproc:
        p.add_argument("--nproc-per-node", type=int, default=0, metavar="N",
                       help="processes per node (one per GPU; sets slurm.gpus_per_node unless that is given)")
    p.set_defaults(script_args=None)


def parse_with_overrides(parser: argparse.ArgumentParser, argv: Sequence[str] | None) -> argparse.Namespace:
    """``parser``'s arguments, with key=value items allowed before or after options: argparse alone would reject
    those after an option, so leftovers of that form are added to the overrides. Everything after the first ``--``
    is a script's (args.script_args), never read here, for the commands that run one (add_script_args)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    script_args = argv[argv.index("--") + 1:] if "--" in argv else None
    args, extra = parser.parse_known_args(argv[:argv.index("--")] if "--" in argv else argv)
    stray = [e for e in extra if e.startswith("-") or "=" not in e or not hasattr(args, "overrides")]
    if stray:
        parser.error(f"unrecognized arguments: {' '.join(stray)}")
    if extra:
        args.overrides = list(args.overrides) + extra
    if script_args is not None:
        if not hasattr(args, "script_args"):
            parser.error(f"unrecognized arguments: -- {' '.join(script_args)} (only the commands that run a "
                         "script, with --script or --module, take arguments after --)")
        args.script_args = script_args
    return args
