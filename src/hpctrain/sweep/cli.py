"""The `hpctrain sweep` subcommands' arguments (kept here so that cli.py stays a list of commands)."""

from __future__ import annotations

import argparse
from typing import Callable


def add_sweep_parser(sub, add_run_args: Callable[[argparse.ArgumentParser], None]) -> None:
    sweep = sub.add_parser("sweep", help="a grid of settings as one Slurm job array (or run here one after another)")
    ssub = sweep.add_subparsers(dest="sweep_command", required=True, metavar="SUBCOMMAND")
    submit = ssub.add_parser("submit", help="check every point, write the sweep dir, submit one job array (or --local)")
    add_run_args(submit)
    submit.add_argument("--grid", action="append", default=[], metavar="KEY=V1,V2,...", required=True,
                        help="an axis of the grid (repeat for more; the points are every combination)")
    submit.add_argument("--dir", dest="sweep_dir", default="", metavar="SWEEP_DIR",
                        help="the sweep directory (default sweeps/EXPERIMENT): sweep.toml, a run dir per point, logs")
    submit.add_argument("--max-parallel", type=int, default=0, metavar="K",
                        help="at most K points at once (sbatch --array=...%%K; default: no limit)")
    submit.add_argument("--local", action="store_true", help="run the points here, one after another, no Slurm")
    submit.add_argument("--nproc-per-node", type=int, default=1, metavar="N",
                        help="with --local: processes per point (as hpctrain train --nproc-per-node)")
    submit.add_argument("--dry-run", action="store_true", help="print the point table and the array script only")
    submit.add_argument("--allow-large", action="store_true", help="allow a grid of more than 1,000 points")
    submit.add_argument("--force", action="store_true", help="submit despite errors found by the check (with "
                        "--local: run although no squeue here can check the sweep's array job has ended)")
    submit.set_defaults(func=run_sweep, command_name="sweep-submit")
    status = ssub.add_parser("status", help="every point's state, step and latest validation metric")
    status.add_argument("sweep_dir", metavar="SWEEP_DIR")
    status.add_argument("--debug", action="store_true", help="show tracebacks")
    status.set_defaults(func=run_sweep, command_name="sweep-status")


def run_sweep(args: argparse.Namespace) -> int:
    from hpctrain.sweep import commands, status

    if args.command_name == "sweep-status":
        return status.status_command(args.sweep_dir)
    req = commands.SubmitRequest(args.experiment, args.config_file, tuple(args.overrides), tuple(args.grid),
                                 args.sweep_dir or f"sweeps/{args.experiment.replace(':', '-')}", args.max_parallel,
                                 args.local, args.nproc_per_node, args.dry_run, args.allow_large, args.force)
    return commands.submit_command(req)
