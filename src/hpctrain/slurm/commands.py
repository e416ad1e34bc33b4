"""`hpctrain slurm render|check|submit|status|cancel|logs`: glue between the CLI and slurm/*."""

from __future__ import annotations

import shlex
import sys
import time
from pathlib import Path

from hpctrain.config.load import config_to_toml, flat_differences
from hpctrain.config.schema import RunConfig
from hpctrain.errors import UserError
from hpctrain.metrics.records import metric_values, read_metrics
from hpctrain.slurm import facts, job, lint, render


def _resolve(experiment: str, config_file: str | None, overrides: tuple[str, ...]) -> RunConfig:
    from hpctrain.train.entry import resolve

    return resolve(experiment, config_file, overrides)[1]


def render_command(experiment: str, config_file: str | None, overrides: tuple[str, ...]) -> int:
    cfg = _resolve(experiment, config_file, overrides)
    print(render.render_script(job.job_spec(cfg)), end="")
    return 0


def check_findings(cfg: RunConfig, spec: render.JobSpec, extra: list[lint.Finding] = ()) -> list[lint.Finding]:
    findings = [*extra, *lint.lint(cfg, spec, facts.gather_facts(cfg, spec))]
    for f in findings:
        print(f.format(), file=sys.stderr)
    return findings


def check_command(experiment: str, config_file: str | None, overrides: tuple[str, ...]) -> int:
    cfg = _resolve(experiment, config_file, overrides)
    findings = check_findings(cfg, job.job_spec(cfg))
    errors, warnings = (sum(f.level == level for f in findings) for level in ("error", "warning"))
    notes = len(findings) - errors - warnings
    print(f"hpctrain slurm check: {errors} error(s), {warnings} warning(s)" + (f", {notes} note(s)" if notes else ""),
          file=sys.stderr)
    return 1 if errors else 0


def submit_command(experiment: str, config_file: str | None, overrides: tuple[str, ...], force: bool) -> int:
    from hpctrain.train.entry import check_resume

    cfg = _resolve(experiment, config_file, overrides)
    spec = job.job_spec(cfg)
    # What would fail on the nodes after the queue wait, refused here whatever --force says: a second writer of the
    # run dir (its own job queued or running, or a training holding it), a checkpoint this config cannot resume
    # (its batch, its optimizer, a model whose parameters it does not fit). --force only submits when Slurm did not
    # answer whether the run dir's job still runs.
    job.refuse_busy_run_dir(Path(spec.run_dir), force)
    checkpoint = check_resume(cfg)
    findings = check_findings(cfg, spec, model_changes(cfg, checkpoint))
    errors = [f for f in findings if f.level == "error"]
    if errors and not force:
        raise UserError(f"not submitted: {len(errors)} error(s) in the job (listed above)",
                        "fix them, or submit anyway with --force if you know better than the check.")
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


def status_command(target: str) -> int:
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
        print(progress_line(run_dir))
    return 0


def progress_line(run_dir: Path) -> str:
    """Training progress from the run dir: last step, loss, validation metrics, newest checkpoint."""
    metrics = run_dir / "metrics.jsonl"
    records = read_metrics(metrics) if metrics.exists() else []
    train = [r for r in records if r["split"] == "train"]
    val = [r for r in records if r["split"] == "val"]
    latest = run_dir / "checkpoints" / "latest"
    parts = [f"run {run_dir}:"]
    step = latest_step(records)
    if train:
        at = f" at step {train[-1]['step']}" if train[-1]["step"] != step else ""
        parts.append(f"step {step}, train loss {train[-1].get('loss', float('nan')):.4g}{at}")
    else:
        parts.append("no training step logged yet" if step is None else f"step {step}, no train record yet")
    if val:
        parts.append(f"val at step {val[-1]['step']}: "
                     + ", ".join(f"{k} {v:.4g}" for k, v in metric_values(val[-1]).items()))
    parts.append(f"checkpoint {latest.read_text().strip()}" if latest.exists() else "no checkpoint yet")
    return " ".join(parts[:2]) + ("; " + "; ".join(parts[2:]) if len(parts) > 2 else "")


def latest_step(records: list[dict]) -> int | None:
    """The run's latest step: that of its newest train, stop or resume record (a stop writes no train record, so
    that log windows stay aligned across the resume: the last train record may be steps behind)."""
    steps = [r["step"] for r in records if r.get("split") in ("train", "stop", "resume")]
    return steps[-1] if steps else None


def cancel_command(target: str, signal: str) -> int:
    job_id, _ = job.resolve_target(target)
    job.cancel(job_id, signal)
    print(f"job {job_id}: " + (f"sent {signal} to the batch shell, which passes it to every task" if signal else "cancelled"))
    return 0


def logs_command(target: str, lines: int, follow: bool) -> int:
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
