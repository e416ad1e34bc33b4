"""`hpctrain slurm render|check|submit|status|cancel|logs`: their arguments and runs. render, check and submit
resolve the run's config (resolution.py) and compose slurm/: the job spec and script (job, render), what this
machine and sinfo show (facts, with the shard folders the experiment reads), the lint, sbatch; status, cancel and
logs ask Slurm about a run dir's or a job id's job."""

from __future__ import annotations

import argparse
import dataclasses
import shlex
import sys
import time
from pathlib import Path

from hpctrain.commands.arguments import add_run_args, add_script_args, check_nproc
from hpctrain.commands.scripts import script_request, with_processes, write_run_files
from hpctrain.config.load import config_to_toml, flat_differences
from hpctrain.config.schema import RunConfig
from hpctrain.errors import UserError
from hpctrain.fault import submit_guard
from hpctrain.metrics.trackers.build import offline_sync_command
from hpctrain.slurm import exits, facts, job, lint, render
from hpctrain.slurm.progress import progress_line


def add_parser(sub) -> None:
    slurm = sub.add_parser("slurm", help="render, check, submit and follow Slurm jobs")
    ssub = slurm.add_subparsers(dest="slurm_command", required=True, metavar="SUBCOMMAND")
    for name, text in (("render", "print the sbatch script"), ("check", "lint the job (exit 1 on errors)"),
                       ("submit", "check, write the script into the run dir, sbatch it, print the job id")):
        p = ssub.add_parser(name, help=text, description=f"hpctrain slurm {name} EXPERIMENT [--config F] [key=value "
                            "...], or with --script PATH | --module MODULE [--nproc-per-node N] instead of EXPERIMENT "
                            "and the script's arguments after -- (docs/scripts.md).")
        add_run_args(p, optional=True)
        add_script_args(p)
        if name == "submit":
            p.add_argument("--force", action="store_true",
                           help="submit despite errors found by the check, or when Slurm did not answer whether the "
                                "run dir's job still runs")
            p.add_argument("--preflight", action="store_true",
                           help="run hpctrain doctor --perf on all ranks first; a failed check ends the job before "
                           "training (same as slurm.preflight=true; options in slurm.preflight_args)")
        p.set_defaults(run=run, command_name=name)
    for name, text in (("status", "Slurm state and training progress"), ("cancel", "cancel the job"),
                       ("logs", "print (or follow) the job's log")):
        p = ssub.add_parser(name, help=text)
        p.add_argument("target", metavar="RUN_DIR|JOB_ID",
                       help="a run dir submitted from, a job id, or a sweep's array task (JOBID_INDEX)")
        p.add_argument("--debug", action="store_true", help="show tracebacks")
        if name == "cancel":
            p.add_argument("--signal", default="", metavar="SIG",
                           help="instead of cancelling, send SIG (e.g. USR2: checkpoint and requeue) to the job")
        if name == "logs":
            p.add_argument("-n", "--lines", type=int, default=40, help="lines from the end (default 40)")
            p.add_argument("-f", "--follow", action="store_true",
                           help="keep printing as the log grows, until the job ends")
        p.set_defaults(run=run, command_name=name)


def run(args: argparse.Namespace) -> int:
    name = args.command_name
    if name == "status":
        return show_status(args.target)
    if name == "cancel":
        return cancel_job(args.target, args.signal)
    if name == "logs":
        return show_logs(args.target, args.lines, args.follow)
    preflight = ("slurm.preflight=true",) if name == "submit" and args.preflight else ()
    script = script_request(args)
    if script is not None:
        script = dataclasses.replace(script, overrides=script.overrides + preflight)
        cfg = script.resolve(job=True)
        spec = job.job_spec(cfg, script_args=script.script_args, settings_toml=script.settings(cfg, job=True),
                            nproc_per_node=script.nproc_per_node)
    else:
        cfg, spec = experiment_job(args, preflight)
    if name == "render":
        print(render.render_script(spec), end="")
        return 0
    if name == "check":
        return check_job(cfg, spec)
    return submit_job(cfg, spec, args.force) if script is None else submit_script_job(cfg, spec, args.force)


def experiment_job(args: argparse.Namespace, preflight: tuple[str, ...]) -> tuple[RunConfig, render.JobSpec]:
    """An experiment's config and job spec; --nproc-per-node N sets slurm.gpus_per_node as for a script."""
    from hpctrain.resolution import resolve_config

    nproc = check_nproc(args.nproc_per_node)
    overrides = with_processes(args.experiment, args.config_file, (*args.overrides, *preflight), nproc)
    cfg = resolve_config(args.experiment, args.config_file, overrides)[1]
    return cfg, job.job_spec(cfg, nproc_per_node=nproc)


def shard_dirs(cfg: RunConfig) -> tuple[str, ...]:
    """The shard folders the run's experiment reads (as its config sets them), for the facts; none for a script."""
    if cfg.script is not None:
        return ()
    from hpctrain.experiments import resolve_experiment

    return tuple(resolve_experiment(cfg.experiment)(cfg).shard_dirs())


def check_findings(cfg: RunConfig, spec: render.JobSpec, extra: list[lint.Finding] = ()) -> list[lint.Finding]:
    findings = [*extra, *lint.lint(cfg, spec, facts.gather_facts(cfg, spec, shard_dirs(cfg)))]
    for f in findings:
        print(f.format(), file=sys.stderr)
    return findings


def check_job(cfg: RunConfig, spec: render.JobSpec) -> int:
    findings = check_findings(cfg, spec)
    errors, warnings = (sum(f.level == level for f in findings) for level in ("error", "warning"))
    notes = len(findings) - errors - warnings
    print(f"hpctrain slurm check: {errors} error(s), {warnings} warning(s)" + (f", {notes} note(s)" if notes else ""),
          file=sys.stderr)
    return 1 if errors else 0


def submit_job(cfg: RunConfig, spec: render.JobSpec, force: bool) -> int:
    from hpctrain.metrics.trackers.build import check_installed
    from hpctrain.train.resume_check import check_resume

    # What would fail on the nodes after the queue wait, refused here whatever --force says: a second writer of the
    # run dir (its own job queued or running, or a training holding it), a checkpoint this config cannot resume
    # (its batch, its optimizer, a model whose parameters it does not fit). --force only submits when Slurm did not
    # answer whether the run dir's job still runs.
    submit_guard.refuse_busy_run_dir(Path(spec.run_dir), force)
    check_installed(cfg.log.trackers)  # the job's environment is this one (slurm.python: the same interpreter)
    checkpoint = check_resume(cfg)
    refuse_errors(check_findings(cfg, spec, model_changes(cfg, checkpoint)), force)
    return sbatch(spec)


def submit_script_job(cfg: RunConfig, spec: render.JobSpec, force: bool) -> int:
    """A script job: the same refusals (a second writer of the run dir, the lint's errors), the resolved config and
    the settings written into the run dir before sbatch (the job writes them again, as rendered), then sbatch.
    No checkpoint checks: the script's checkpoints are its own."""
    submit_guard.refuse_busy_run_dir(Path(spec.run_dir), force)
    refuse_errors(check_findings(cfg, spec), force)
    write_run_files(dataclasses.replace(cfg, run=dataclasses.replace(cfg.run, dir=spec.run_dir)),
                    spec.script.settings_toml)
    return sbatch(spec)


def refuse_errors(findings: list[lint.Finding], force: bool) -> None:
    errors = [f for f in findings if f.level == "error"]
    if errors and not force:
        raise UserError(f"not submitted: {len(errors)} error(s) in the job (listed above)",
                        "fix them, or submit anyway with --force if you know better than the check.")


def sbatch(spec: render.JobSpec) -> int:
    """The rendered script into the run dir, sbatch, and what to type next."""
    job_id = job.submit(render.render_script(spec), Path(spec.run_dir))
    print(job_id)
    print(f"hpctrain: submitted job {job_id}; run dir {spec.run_dir}\n"
          f"  {shlex.join(['hpctrain', 'slurm', 'status', spec.run_dir])}\n"
          f"  {shlex.join(['hpctrain', 'slurm', 'logs', spec.run_dir, '--follow'])}", file=sys.stderr)
    return 0


def model_changes(cfg: RunConfig, checkpoint: Path | None) -> list[lint.Finding]:
    """[model] settings that differ from those of the checkpoint the job would resume. Local train refuses such a
    resume only when the model's parameters no longer fit the checkpoint's (names or shapes: the strict load), and
    so does this, before the queue wait (a UserError, which --force does not pass: the job would fail on every rank
    at its restore). A change that leaves them alone (a dropout rate) resumes, as it does locally: a warning names
    the keys."""
    from hpctrain.config.changes import saved_config

    saved = saved_config(checkpoint) if checkpoint is not None else None
    if saved is None:  # none, or unreadable (a torn write): the job's restore verifies the checkpoint
        return []
    changed = [(key, then, now) for key, then, now in flat_differences(saved, config_to_toml(cfg))
               if key.startswith("model.") and then is not None]  # None: a key the checkpoint's hpctrain did not have
    if not changed:
        return []
    what = ", ".join(f"{key} is {now} here but {then}" for key, then, now in changed)
    misfit, unchecked = model_misfit(cfg, checkpoint)
    if misfit:
        raise UserError(f"not submitted: checkpoint {checkpoint}, which this job would resume, does not fit this "
                        f"model ({misfit}): {what} in it",
                        "resume with the [model] settings the run was started with (config.toml in the checkpoint), "
                        "or use a new run.dir.")
    fits = (f"its parameters could not be compared here ({unchecked}): the job's restore checks them"
            if unchecked else "the parameters' names and shapes are unchanged, so it resumes with the new settings")
    return [lint.Finding("warning", "model", f"{what} in {checkpoint}, which this job would resume; {fits}",
                         "nothing to do if the change is meant; else resume with the checkpoint's [model] settings.")]


def model_misfit(cfg: RunConfig, checkpoint: Path) -> tuple[str, str]:
    """(what does not fit, '') when the model this config builds has other parameter names or shapes than the
    checkpoint's (its DCP metadata), ('', '') when they fit, ('', why) when that cannot be told here. The model is
    built on the meta device: no memory, no weights."""
    try:
        import torch
        from torch.distributed.checkpoint import FileSystemReader

        from hpctrain.checkpoint.state_dicts import DCP_DIR
        from hpctrain.experiments import resolve_experiment

        metadata = FileSystemReader(str(checkpoint / DCP_DIR)).read_metadata().state_dict_metadata
        with torch.device("meta"):
            model = resolve_experiment(cfg.experiment)(cfg).build_model()
        built = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    except Exception as err:  # noqa: BLE001 - an experiment that cannot build on the meta device: the job checks
        return "", f"{type(err).__name__}: {err}"
    saved = {key[len("model."):]: tuple(getattr(meta, "size", ()) or ())
             for key, meta in metadata.items() if key.startswith("model.")}
    missing, unexpected = sorted(saved.keys() - built.keys()), sorted(built.keys() - saved.keys())
    shapes = [f"{name} {list(saved[name])} in it, {list(built[name])} here"
              for name in sorted(saved.keys() & built.keys()) if saved[name] != built[name]]
    parts = ([f"shape of {', '.join(shapes[:3])}"] if shapes else []) \
        + ([f"not in this model: {', '.join(missing[:3])}"] if missing else []) \
        + ([f"not in the checkpoint: {', '.join(unexpected[:3])}"] if unexpected else [])
    return "; ".join(parts), ""


def show_status(target: str) -> int:
    job_id, run_dir = job.resolve_target(target)
    fields = job.job_state(job_id)
    if not fields:
        print(f"job {job_id}: unknown to Slurm (ended long ago, and no accounting database to ask)")
    else:
        restarts = fields.get("Restarts", "0")
        print(f"job {job_id}: {fields.get('JobState', '?')}"
              + (f" ({fields['Reason']})" if fields.get("Reason", "None") not in ("None", "") else "")
              + f", run time {fields.get('RunTime', '?')} of {fields.get('TimeLimit', '?')}"
              + f", nodes {fields.get('NodeList', '?') or '-'}"
              + (f", exit code {fields['ExitCode']}" if fields.get("ExitCode") not in (None, "0:0") else "")
              + (f", requeued {restarts} time(s)" if restarts not in ("0", "") else ""))
    if run_dir is not None:
        print(progress_line(run_dir, script=is_script_run(run_dir)))
        failure = exits.failure_line(exits.latest_records(run_dir, job_id))
        if failure:  # a script job's: the rank that failed first, its host and its last error line
            print(failure)
        sync = offline_sync_command(run_dir)
        if sync:
            print(f"W&B offline run; upload it with: {sync}")
    return 0


def is_script_run(run_dir: Path) -> bool:
    """Whether the run dir's config.toml names a script job ('script:...'); False when it has none yet."""
    from hpctrain.config.target import is_script
    from hpctrain.resolution import run_experiment_name

    try:
        return is_script(run_experiment_name(run_dir / "config.toml"))
    except UserError:
        return False


def cancel_job(target: str, signal: str) -> int:
    job_id, _ = job.resolve_target(target)
    job.cancel(job_id, signal)
    print(f"job {job_id}: " + (f"sent {signal} to the batch shell, which passes it to every task" if signal else "cancelled"))
    return 0


def show_logs(target: str, lines: int, follow: bool) -> int:
    job_id, run_dir = job.resolve_target(target)
    files = job.log_files(job_id, run_dir)
    if not files:
        raise UserError(f"no log file of job {job_id} yet",
                        "a pending job has no log; check 'hpctrain slurm status' (the log appears when it starts).")
    path = files[-1]
    if follow:
        return follow_log(path, job_id, lines)
    text = path.read_text(errors="replace").splitlines()
    print(f"==> {path} <==")
    print("\n".join(text[-lines:]))
    return 0


FOLLOW_POLL_S = 1.0
"""How often --follow looks for new lines in the log."""
FOLLOW_STATE_S = 10.0
"""How often --follow asks Slurm whether the job still runs (scontrol: a request to the controller)."""


def follow_log(path: Path, job_id: str, lines: int) -> int:
    """The log's last lines, then what the job adds, until it has ended (tail -F never ended: issue 38 item 7).
    A requeued job pends again and goes on writing here, so it is followed on. Ctrl-C ends it at once."""
    print(f"==> {path} <== (following job {job_id} until it ends; Ctrl-C stops)", file=sys.stderr)
    try:
        with open(path, errors="replace") as log:
            sys.stdout.write("".join(log.readlines()[-lines:]))
            asked, unanswered = 0.0, False
            while True:
                sys.stdout.write(log.read())
                sys.stdout.flush()
                if time.monotonic() - asked >= FOLLOW_STATE_S:
                    asked = time.monotonic()
                    try:
                        state = job.job_fields(job_id).get("JobState", "")  # {} once Slurm forgot it: ended
                    except job.SlurmUnanswered as err:  # says nothing about the job: follow on, ask again later
                        if not unanswered:
                            print(f"hpctrain: {err.args[0]}; still following, asking again", file=sys.stderr)
                        unanswered, state = True, None
                    else:
                        unanswered = False
                    if state is not None and (not state or state in job.ENDED):
                        sys.stdout.write(log.read())  # what it wrote before it ended
                        print(f"hpctrain: job {job_id} has ended ({state or 'no longer known to Slurm'})",
                              file=sys.stderr)
                        return 0
                time.sleep(FOLLOW_POLL_S)
    except KeyboardInterrupt:
        return 130
