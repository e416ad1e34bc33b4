"""`hpctrain check resume TARGET`: does this training resume exactly? An experiment (name or module:Class) or a
script (a path to a .py file with a loop under hpctrain.session) runs K steps uninterrupted, then again stopped by
the preemption signal (SIGTERM to rank 0) mid-run and resumed from its checkpoint; every step of both runs is
compared: the micro-batches each rank trained on, each optimizer's learning rate, the state of every checkpointed
object after the step (train/resume_record.py), and the logged values. The first difference is named (its step and
what differs), or the run resumes exactly. Exit 0 when it does, 1 when it does not.

The classic mistakes it finds: a scheduler that is not registered (the learning rate differs after the resume), a
sampler or data loader of the script's own (the micro-batches differ), state kept outside the registry (a counter,
a replay buffer), random draws that are not restored (a global draw on another number of processes, in loader
workers), nondeterministic operations.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from hpctrain.errors import UserError

STOP_CODE = 75
"""What a run stopped by SIGTERM exits with under the settings the check gives it (fault.exit_code's default)."""


def add_parser(sub) -> None:
    check = sub.add_parser("check", help="check a training for what users get wrong (check resume)")
    csub = check.add_subparsers(dest="check_command", required=True, metavar="CHECK")
    p = csub.add_parser(
        "resume", help="run K steps straight and again stopped by SIGTERM and resumed; name the first difference",
        description="hpctrain check resume EXPERIMENT|SCRIPT.py [key=value ...] [--steps K] [--stop-after S] "
        "[--nproc-per-node N] [--resume-nproc M] [-- SCRIPT ARGS]")
    p.add_argument("target", metavar="EXPERIMENT|SCRIPT", help="an experiment (name or module:Class) or a .py script "
                   "whose loop runs under hpctrain.session()")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="settings for both runs")
    p.add_argument("--config", dest="config_file", metavar="FILE", help="TOML settings (below key=value)")
    p.add_argument("--steps", type=int, default=8, metavar="K", help="steps of each run (default 8)")
    p.add_argument("--stop-after", type=int, default=0, metavar="S",
                   help="step after which rank 0 gets SIGTERM (default K/2-1; the stop lands a step or two later)")
    p.add_argument("--nproc-per-node", type=int, default=1, metavar="N", help="processes of both runs (default 1)")
    p.add_argument("--resume-nproc", type=int, default=0, metavar="M",
                   help="resume on M processes instead of N (world-size changes: losses compared to 1e-5)")
    p.add_argument("--dir", metavar="DIR", help="where the runs go (default: a temporary folder, kept when they "
                   "differ)")
    p.add_argument("--timeout", type=float, default=600.0, metavar="SECONDS", help="limit per launch (default 600)")
    p.add_argument("--debug", action="store_true", help="show tracebacks")
    p.set_defaults(run=run, command_name="check", script_args=None)


@dataclass(frozen=True)
class Plan:
    target: str
    script: bool
    """The target is a script (its settings go through HPCTRAIN_SETTINGS), not an experiment."""
    overrides: tuple[str, ...]
    config_file: str | None
    script_args: tuple[str, ...]
    steps: int
    stop_after: int
    nproc: int
    resume_nproc: int


def plan_of(args: argparse.Namespace) -> Plan:
    script = args.target.endswith(".py")
    if script and not Path(args.target).is_file():
        raise UserError(f"script '{args.target}' does not exist", "give the path of your training script.")
    script_args = args.script_args or []
    if script_args and not script:
        raise UserError("arguments after -- are a script's, and the target is an experiment",
                        "set an experiment's settings as key=value, or give a .py script.")
    if args.steps < 3:
        raise UserError(f"--steps {args.steps}: too few to stop and resume in between", "use --steps 3 or more.")
    stop_after = args.stop_after or max(1, args.steps // 2 - 1)
    if not 0 < stop_after < args.steps - 1:
        raise UserError(f"--stop-after {stop_after} leaves no step to resume (with --steps {args.steps})",
                        f"choose --stop-after between 1 and {args.steps - 2}.")
    for flag, value in (("--nproc-per-node", args.nproc_per_node), ("--resume-nproc", args.resume_nproc)):
        if value < 0 or (flag == "--nproc-per-node" and value == 0):
            raise UserError(f"{flag} {value}: give a positive number of processes")
    return Plan(args.target, script, tuple(args.overrides), args.config_file, tuple(script_args), args.steps,
                stop_after, args.nproc_per_node, args.resume_nproc or args.nproc_per_node)


def run(args: argparse.Namespace) -> int:
    plan = plan_of(args)
    work = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="hpctrain-check-resume-"))
    work.mkdir(parents=True, exist_ok=True)
    print(f"hpctrain check resume: {plan.target}, {plan.steps} steps on {plan.nproc} process(es), once straight and "
          f"once stopped by SIGTERM after step {plan.stop_after} and resumed on {plan.resume_nproc}; runs in {work}",
          flush=True)
    straight, resumed = work / "straight", work / "resumed"
    for folder in (straight, resumed):
        shutil.rmtree(folder, ignore_errors=True)
    _launch(plan, straight, plan.nproc, args.timeout, expect=0, what="the uninterrupted run")
    stopped = {"HPCTRAIN_FAULT": f"signal:rank=0:step={plan.stop_after}:phase=data:signal=SIGTERM"}
    _launch(plan, resumed, plan.nproc, args.timeout, expect=STOP_CODE, what="the run to stop", env=stopped)
    stop_step = _stop_step(resumed / "run")
    _launch(plan, resumed, plan.resume_nproc, args.timeout, expect=0, what="the resumed run")
    verdict = compare(straight, resumed)
    print(render_verdict(plan, stop_step, verdict))
    if verdict:
        print(f"the runs are kept in {work} (run/metrics.jsonl, records/rank_N.jsonl)")
        return 1
    if not args.dir:
        shutil.rmtree(work, ignore_errors=True)
    return 0


def _launch(plan: Plan, folder: Path, nproc: int, timeout: float, expect: int, what: str,
            env: dict[str, str] | None = None) -> None:
    run_dir, records = folder / "run", folder / "records"
    forced = [f"run.dir={run_dir.resolve()}", f"train.max_steps={plan.steps}", "log.every_steps=1",
              "ckpt.every_steps=0", "ckpt.every_minutes=0", "ckpt.async_save=false", "fault.requeue=false",
              f"fault.exit_code={STOP_CODE}"]
    full_env = {**os.environ, "HPCTRAIN_RESUME_RECORD": str(records.resolve()), **(env or {})}
    target = ["--script", plan.target] if plan.script else [plan.target]
    cmd = [sys.executable, "-m", "hpctrain", "train", *target, f"--nproc-per-node={nproc}",
           *(["--config", plan.config_file] if plan.config_file else []), *plan.overrides, *forced,
           *(["--", *plan.script_args] if plan.script else [])]
    log_path = folder / f"launch_{len(list(folder.glob('launch_*.log')))}.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "w") as out:
        try:
            done = subprocess.run(cmd, env=full_env, stdout=out, stderr=subprocess.STDOUT, timeout=timeout)
        except subprocess.TimeoutExpired:
            raise UserError(f"{what} did not end within {timeout:.0f} s (log: {log_path})",
                            "give it more time (--timeout) or fewer steps (--steps).") from None
    if done.returncode != expect:
        tail = "\n".join(log_path.read_text(errors="replace").splitlines()[-15:])
        hint = ("the run ended before the stop arrived: raise --steps or lower --stop-after."
                if expect == STOP_CODE and done.returncode == 0 else
                "make the training run on its own first (its log above); a script's loop must run under "
                "hpctrain.session() and take its steps from run.steps.")
        raise UserError(f"{what} exited with {done.returncode}, not {expect} (log: {log_path}):\n{tail}", hint)


def _stop_step(run_dir: Path) -> int:
    from hpctrain.metrics.records import read_metrics

    stops = [r["step"] for r in read_metrics(run_dir / "metrics.jsonl") if r.get("split") == "stop"]
    return stops[-1] if stops else 0


def compare(straight: Path, resumed: Path) -> str:
    """The first difference of the resumed run from the straight one ('' when none)."""
    from hpctrain.metrics.records import read_metrics
    from hpctrain.train.resume_record import first_difference, read_records

    a, b = read_records(straight / "records"), read_records(resumed / "records")
    if not a or not b:
        return ("no per-step records were written: the training did not run through hpctrain's loop (an "
                "Experiment, or a script's loop over run.steps)")
    return first_difference(a, b, read_metrics(straight / "run" / "metrics.jsonl"),
                            read_metrics(resumed / "run" / "metrics.jsonl"))


def render_verdict(plan: Plan, stop_step: int, difference: str) -> str:
    """The check's last lines: where the run was stopped, and the verdict."""
    head = f"stopped at step {stop_step} of {plan.steps}" if stop_step else "stopped"
    if difference:
        return f"{head}; the resumed run differs from the uninterrupted one:\n  {difference}"
    compared = "batches, learning rates, checkpointed state and logged values" if plan.resume_nproc == plan.nproc \
        else "learning rates and logged values (to 1e-5: another number of processes)"
    return f"{head}; resumed exactly: every step's {compared} equal the uninterrupted run's"
