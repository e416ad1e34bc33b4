"""`hpctrain sweep submit|status`: their arguments and runs. submit resolves and checks every point of the grid
(sweep/spec.py), then runs them here one after another (sweep/local.py) or lints and submits them as one Slurm job
array (sweep/array.py, the single-run render, lint and sbatch); status prints each point's state (sweep/status.py)."""

from __future__ import annotations

import argparse
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path

from hpctrain.commands.arguments import add_run_args, add_script_args, check_nproc
from hpctrain.commands.scripts import script_request, with_processes
from hpctrain.commands.slurm import shard_dirs
from hpctrain.config.target import is_script
from hpctrain.errors import UserError
from hpctrain.fault import submit_guard
from hpctrain.metrics.trackers.build import check_installed
from hpctrain.slurm import facts, job, lint, render
from hpctrain.sweep.array import array_spec, point_table, refuse_live_array, unfinished
from hpctrain.sweep.local import run_locally
from hpctrain.sweep.metric import check_metric_line
from hpctrain.sweep.spec import SWEEP_FILE, SweepSpec, build_sweep, check_same_sweep, read_plan, write_sweep
from hpctrain.sweep.status import collect_status, status_text


def add_parser(sub) -> None:
    sweep = sub.add_parser("sweep", help="a grid of settings as one Slurm job array (or run here one after another)")
    ssub = sweep.add_subparsers(dest="sweep_command", required=True, metavar="SUBCOMMAND")
    submit = ssub.add_parser(
        "submit", help="check every point, write the sweep dir, submit one job array (or --local)",
        description="hpctrain sweep submit EXPERIMENT --grid KEY=V1,V2 ... [key=value ...], or --script PATH | "
        "--module MODULE instead of EXPERIMENT with the script's arguments after --: then a --grid KEY without a dot "
        "is a script argument (--KEY VALUE, or VALUE in place of {KEY} after --) (docs/sweeps.md).")
    add_run_args(submit, optional=True)
    add_script_args(submit, nproc=False)
    submit.add_argument("--metric", default="", metavar="NAME",
                        help="a script's sweep: the metric the points are compared by, from their metrics.jsonl "
                        "(default loss), or the name of --metric-line's")
    submit.add_argument("--metric-line", default="", metavar="REGEX",
                        help="a script's sweep: read the metric from the point's log, the first group of each match "
                        "(e.g. 'val_loss=([0-9.eE+-]+)'; a group named step gives its step)")
    submit.add_argument("--higher-is-better", action="store_true",
                        help="a script's sweep: a larger metric is better (default: smaller, as for a loss)")
    submit.add_argument("--grid", action="append", default=[], metavar="KEY=V1,V2,...", required=True,
                        help="an axis of the grid (repeat for more; the points are every combination)")
    submit.add_argument("--dir", dest="sweep_dir", default="", metavar="SWEEP_DIR",
                        help="the sweep directory (default sweeps/EXPERIMENT): sweep.toml, a run dir per point, logs")
    submit.add_argument("--max-parallel", type=int, default=0, metavar="K",
                        help="at most K points at once (sbatch --array=...%%K; default: no limit)")
    submit.add_argument("--local", action="store_true", help="run the points here, one after another, no Slurm")
    submit.add_argument("--nproc-per-node", type=int, default=0, metavar="N",
                        help="with --local: processes per point (as hpctrain train --nproc-per-node); a script's "
                        "sweep on Slurm: processes per node (sets slurm.gpus_per_node unless that is given)")
    submit.add_argument("--dry-run", action="store_true", help="print the point table and the array script only")
    submit.add_argument("--allow-large", action="store_true", help="allow a grid of more than 1,000 points")
    submit.add_argument("--force", action="store_true", help="submit despite errors found by the check (with "
                        "--local: run although no squeue here can check the sweep's array job has ended)")
    submit.set_defaults(run=run, command_name="sweep-submit")
    status = ssub.add_parser("status", help="every point's state, step and latest validation metric")
    status.add_argument("sweep_dir", metavar="SWEEP_DIR")
    status.add_argument("--debug", action="store_true", help="show tracebacks")
    status.set_defaults(run=run, command_name="sweep-status")


def run(args: argparse.Namespace) -> int:
    if args.command_name == "sweep-status":
        plan = read_plan(Path(args.sweep_dir))
        print(status_text(plan, collect_status(plan)))
        return 0
    script = script_request(args)
    if script is None:
        if args.metric or args.metric_line or args.higher_is_better:
            raise UserError("--metric, --metric-line and --higher-is-better are for a script's sweep",
                            "an experiment's sweep compares its points by the experiment's own main metric.")
        experiment, overrides = args.experiment, tuple(args.overrides)
        default_dir = f"sweeps/{experiment.replace(':', '-')}"
    else:
        if args.metric_line:
            check_metric_line(args.metric_line)
        experiment, default_dir = script.experiment, f"sweeps/{script.target.run_name}"
        overrides = script.overrides if args.local else \
            with_processes(experiment, script.config_file, script.overrides, check_nproc(args.nproc_per_node))
    req = SubmitRequest(experiment, args.config_file, overrides, tuple(args.grid),
                        args.sweep_dir or default_dir, args.max_parallel,
                        args.local, args.nproc_per_node, args.dry_run, args.allow_large, args.force,
                        script_args=script.script_args if script else (), metric=args.metric,
                        metric_line=args.metric_line, higher_is_better=args.higher_is_better)
    return submit_command(req)


@dataclass(frozen=True)
class SubmitRequest:
    """`hpctrain sweep submit`'s arguments."""

    experiment: str
    """Experiment name or module:Class; a script's sweep: 'script:PATH' or 'script:-m MODULE'."""
    config_file: str | None
    """--config FILE."""
    overrides: tuple[str, ...]
    """key=value items every point shares."""
    grid: tuple[str, ...]
    """The --grid axes, KEY=V1,V2,..."""
    sweep_dir: str
    """--dir, or sweeps/EXPERIMENT."""
    max_parallel: int = 0
    """At most this many points at once (0: no limit)."""
    local: bool = False
    """Run the points here, one after another."""
    nproc_per_node: int = 1
    """With local: processes per point."""
    dry_run: bool = False
    """Print the point table and the array script only."""
    allow_large: bool = False
    """Allow more than MAX_POINTS points."""
    force: bool = False
    """Submit despite the check's errors; with local, run although the array cannot be checked."""
    script_args: tuple[str, ...] = ()
    """A script's sweep: the arguments after -- that every point gets."""
    metric: str = ""
    """A script's sweep: --metric."""
    metric_line: str = ""
    """A script's sweep: --metric-line."""
    higher_is_better: bool = False
    """A script's sweep: --higher-is-better."""


def submit_command(req: SubmitRequest) -> int:
    if req.max_parallel < 0:
        raise UserError(f"--max-parallel {req.max_parallel} is negative", "give how many points may run at once, "
                        "or 0 for no limit.")
    script = dict(script_args=req.script_args, metric=req.metric or "loss", metric_line=req.metric_line,
                  higher_is_better=req.higher_is_better) if is_script(req.experiment) else {}
    plan, configs = build_sweep(req.experiment, req.config_file, req.overrides, list(req.grid), req.sweep_dir,
                                req.allow_large, **script)
    print(point_table(plan), file=sys.stderr)
    for cfg in configs.values():  # log.trackers may be an axis
        check_installed(cfg.log.trackers)
    going_on = (plan.sweep_dir / SWEEP_FILE).exists()
    if going_on:  # another grid or settings in a used dir: refused whatever state its points are in
        check_same_sweep(plan, configs)
    if req.local:
        if req.dry_run:
            return 0
        if going_on:
            refuse_live_array(plan, req.force)
        write_sweep(plan, configs)
        return run_locally(plan, max(1, req.nproc_per_node))
    todo = unfinished(plan) if going_on else ()
    if todo == ("none",):
        print(f"hpctrain: every point of {plan.sweep_dir} is done; nothing to submit "
              f"({shlex.join(['hpctrain', 'report', str(plan.sweep_dir)])})", file=sys.stderr)
        return 0
    # A point that trains here (--local, a plain `hpctrain train`) or in another job would get a second writer.
    submit_guard.refuse_held_run_dirs([Path(configs[p.name].run_dir) for p in plan.points])
    nproc = req.nproc_per_node if is_script(req.experiment) else 0
    spec = array_spec(plan, configs, req.max_parallel, tuple(int(i) for i in todo), nproc)
    if req.dry_run:
        print(render.render_script(spec), end="")
        return 0
    findings = _lint_points(plan, configs, spec)
    errors = [f for f in findings if f.level == "error"]
    if errors and not req.force:
        raise UserError(f"not submitted: {len(errors)} error(s) in the job (listed above)",
                        "fix them, or submit anyway with --force if you know better than the check.")
    write_sweep(plan, configs)
    job_id = job.submit(render.render_script(spec), plan.sweep_dir)
    print(job_id)
    print(f"hpctrain: submitted job array {job_id} ({len(plan.points)} points"
          + (f", at most {req.max_parallel} at once" if req.max_parallel else "") + f"); sweep dir {plan.sweep_dir}\n"
          f"  {shlex.join(['hpctrain', 'sweep', 'status', str(plan.sweep_dir)])}\n"
          f"  {shlex.join(['hpctrain', 'report', str(plan.sweep_dir)])}", file=sys.stderr)
    return 0


def _lint_points(plan: SweepSpec, configs: dict, spec: render.JobSpec) -> list[lint.Finding]:
    """Every point's config linted against the cluster (the facts gathered once); a finding printed once, with the
    points it applies to when not all."""
    first = configs[plan.points[0].name]
    found = facts.gather_facts(first, spec, shard_dirs(first))
    where: dict[lint.Finding, list[str]] = {}
    for p in plan.points:
        for f in lint.lint(configs[p.name], spec, found):
            where.setdefault(f, []).append(p.name.split("_", 1)[0])
    for f, names in where.items():
        text = f.format()
        print(text if len(names) == len(plan.points) else f"{text}\n        (points {', '.join(names)})",
              file=sys.stderr)
    return list(where)
