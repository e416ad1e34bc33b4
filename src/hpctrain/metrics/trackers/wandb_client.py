"""Weights & Biases through its own SDK (wandb.init with a fixed id and resume="allow", run.log with the optimizer
step). hpctrain only chooses the id, the directory and the mode; the rest is wandb's.

Offline (log.wandb_offline), wandb writes each launch's part of the run to RUN_DIR/trackers/wandb/
offline-run-TIME-ID; `wandb sync --id ID` of all of them uploads one run (the parts in order of their start:
wandb sync --help). wandb cannot resume a run offline (it says so and starts at its step 0), which changes
nothing here: every record carries its own step, and no launch sends a step an earlier one sent."""

from __future__ import annotations

import shlex
import uuid
from pathlib import Path
from typing import Any

import numpy as np

from hpctrain.metrics.trackers.state import TRACKERS_DIR, TrackerState

NAME = "wandb"


class WandbClient:
    name = NAME

    def __init__(self, *, run_dir: Path, project: str, entity: str, offline: bool, run_name: str, group: str,
                 tags: tuple[str, ...], params: dict[str, Any], init_timeout_s: float) -> None:
        self.run_dir = run_dir
        self.project = project
        self.entity = entity
        self.offline = offline
        self.run_name = run_name
        self.group = group
        self.tags = tags
        self.params = params
        self.init_timeout_s = init_timeout_s
        self.run = None
        self.run_id = ""
        self.url = ""
        self.extra: dict[str, Any] = {}

    def open(self, state: TrackerState) -> TrackerState:
        import wandb

        run_id = state.run_id or uuid.uuid4().hex[:16]  # chosen here, so the state file names it before wandb runs
        if self.offline:
            # The process's wandb settings offline too, not only the run's: from those wandb decides whether its
            # client telemetry goes to the server (seen with 0.31: a POST to /sdk/otel/v1/metrics from an offline run).
            wandb.setup(settings=wandb.Settings(mode="offline"))
        self.run = wandb.init(
            project=self.project, entity=self.entity or None, id=run_id, resume="allow", name=self.run_name,
            group=self.group or None, tags=list(self.tags) or None, config=self.params,
            dir=str(self.run_dir / TRACKERS_DIR), mode="offline" if self.offline else "online",
            # console off: the job's log already has every line, and wandb's capture would wrap the streams
            # hpctrain's logging and progress bar write to. The timeout: a node without network fails init in
            # this long instead of wandb's 90 s (it runs in the tracker's thread, never the training's).
            settings=wandb.Settings(init_timeout=self.init_timeout_s, console="off", silent=True),
        )
        self.run.config.update(self.params, allow_val_change=True)  # a resume's changed settings
        self.run_id = run_id
        self.url = "" if self.offline else (self.run.url or "")
        self.extra = {"mode": "offline" if self.offline else "online", "project": self.project,
                      "entity": self.entity, "dir": str(self.run_dir / TRACKERS_DIR / "wandb")}
        return TrackerState(uid=state.uid, run_id=run_id, sent_step=state.sent_step, extra=self.extra)

    def send(self, step: int, values: dict[str, float], times: dict[str, float],
             images: list[tuple[str, np.ndarray]]) -> None:
        import wandb

        data: dict[str, Any] = dict(values)
        data.update({tag: wandb.Image(image) for tag, image in images})
        self.run.log(data, step=step)

    def mark_redone(self, start_step: int, sent_step: int) -> None:
        self.run.summary["hpctrain/redone_steps"] = f"{start_step + 1}-{sent_step}"

    def note(self) -> str:
        state = TrackerState(run_id=self.run_id, extra=self.extra)
        command = sync_command(state)
        return f"offline run {self.run_id}; upload it with: {command}" if command else f"run {self.run_id} {self.url}"

    def close(self, complete: bool) -> None:
        if self.run is None:
            return
        if not complete:
            self.run.mark_preempting()  # W&B shows it as preempted, not crashed: a resume continues it
        self.run.finish()
        self.run = None


def sync_command(state: TrackerState) -> str:
    """The `wandb sync` line that uploads an offline run, all its launches' parts ('' for an online run)."""
    if state.extra.get("mode") != "offline" or not state.run_id:
        return ""
    words = ["wandb", "sync", "--id", state.run_id, "--project", state.extra.get("project", "")]
    if state.extra.get("entity"):
        words += ["--entity", state.extra["entity"]]
    # The glob stays unquoted (every launch's part), the directory quoted (a run dir may hold spaces).
    return f"{shlex.join(words)} {shlex.quote(state.extra.get('dir', ''))}/offline-run-*-{state.run_id}"


def log_artifact(state: TrackerState, run_dir: Path, paths: list[Path], name: str, init_timeout_s: float) -> None:
    """``paths`` as one model artifact of the training's W&B run (hpctrain export --to-trackers)."""
    import wandb

    extra = state.extra
    run = wandb.init(project=extra.get("project") or None, entity=extra.get("entity") or None, id=state.run_id,
                     resume="allow", dir=str(run_dir / TRACKERS_DIR), mode=extra.get("mode", "online"),
                     settings=wandb.Settings(init_timeout=init_timeout_s, console="off", silent=True))
    artifact = wandb.Artifact(name, type="model")
    for path in paths:
        artifact.add_file(str(path))
    run.log_artifact(artifact)
    run.finish()
