"""MLflow through its client (MlflowClient: no fluent API, so nothing of the user's active-run state is touched).
A file store in the run dir unless log.mlflow_uri names a tracking server or another store.

MLflow params cannot change once logged: a resume with changed settings logs the new keys and, for a changed
value, a tag hpctrain.changed.KEY saying from which step it holds."""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

import numpy as np

from hpctrain.metrics.trackers.state import TRACKERS_DIR, TrackerState

log = logging.getLogger("hpctrain")

NAME = "mlflow"
UID_TAG = "hpctrain.uid"
GROUP_TAG = "hpctrain.group"
REDONE_TAG = "hpctrain.redone_steps"
MAX_PARAM_VALUE = 6000  # MLflow's limit (mlflow.utils.validation.MAX_PARAM_VAL_LENGTH)
BATCH = 1000  # metrics per log_batch call (MLflow's MAX_METRICS_PER_BATCH)
PARAM_BATCH = 100


def default_uri(run_dir: Path) -> str:
    return (run_dir / TRACKERS_DIR / "mlruns").resolve().as_uri()


def mlflow_settings(uri: str, timeout_s: float) -> None:
    """MLflow's own settings (environment variables it reads at each call), each unless the user set it. Its HTTP
    client retries 7 times with backoff, 120 s each: minutes for a server that is down, bounded here. MLflow 3 keeps
    its file store in maintenance mode and refuses it unless allowed; it is the run dir's default because it needs
    no database and works on a shared file system (a SQLite file there does not lock reliably)."""
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", str(max(1, int(timeout_s))))
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "2")
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR", "1")
    # A server's run URL printed to stdout at each end: stdout is the command's own (hpctrain eval prints JSON
    # there); the end of the log names the run (note()).
    os.environ.setdefault("MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT", "true")
    if uri.startswith("file:"):
        os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")


class MlflowClient:
    name = NAME

    def __init__(self, *, uri: str, experiment: str, run_name: str, group: str, tags: tuple[str, ...],
                 params: dict[str, Any], start_step: int, timeout_s: float) -> None:
        self.uri = uri
        self.experiment = experiment
        self.run_name = run_name
        self.group = group
        self.tags = tags
        self.params = params
        self.start_step = start_step
        self.timeout_s = timeout_s
        self.client = None
        self.run_id = ""

    def open(self, state: TrackerState) -> TrackerState:
        from mlflow.tracking import MlflowClient as Client

        mlflow_settings(self.uri, self.timeout_s)
        self.client = Client(tracking_uri=self.uri)
        if state.extra.get("uri", self.uri) != self.uri:
            # log.mlflow_uri changed since the last launch: the run begins in the new store, and the sink sends it
            # the run so far from metrics.jsonl (sent_step 0)
            log.warning("log.mlflow_uri is %s, the run's MLflow run was at %s: a new run there gets the whole run "
                        "so far", self.uri, state.extra["uri"])
            state = TrackerState(uid=state.uid)
        self.run_id = state.run_id or self._find(state.uid) or self._create(state.uid)
        self.client.update_run(self.run_id, status="RUNNING")
        self._log_params()
        return TrackerState(uid=state.uid, run_id=self.run_id, sent_step=state.sent_step, extra={"uri": self.uri})

    def _experiment_id(self) -> str:
        from mlflow.exceptions import MlflowException

        found = self.client.get_experiment_by_name(self.experiment)
        if found is not None:
            return found.experiment_id
        try:
            return self.client.create_experiment(self.experiment)
        except MlflowException:  # another point of the sweep created it meanwhile
            return self.client.get_experiment_by_name(self.experiment).experiment_id

    def _find(self, uid: str) -> str:
        """The run a launch made before it could write its id (killed in between)."""
        runs = self.client.search_runs([self._experiment_id()], filter_string=f"tags.`{UID_TAG}` = '{uid}'",
                                       max_results=1)
        return runs[0].info.run_id if runs else ""

    def _create(self, uid: str) -> str:
        tags = {UID_TAG: uid, **dict.fromkeys(self.tags, "true")}
        if self.group:
            tags[GROUP_TAG] = self.group
        return self.client.create_run(self._experiment_id(), run_name=self.run_name, tags=tags).info.run_id

    def _log_params(self) -> None:
        from mlflow.entities import Param, RunTag

        logged = self.client.get_run(self.run_id).data.params
        values = {key: str(value)[:MAX_PARAM_VALUE] for key, value in self.params.items()}
        new = [Param(k, v) for k, v in values.items() if k not in logged]
        changed = [RunTag(f"hpctrain.changed.{k}", f"{v} from step {self.start_step} (was {logged[k]})")
                   for k, v in values.items() if k in logged and logged[k] != v]
        for i in range(0, len(new), PARAM_BATCH):
            self.client.log_batch(self.run_id, params=new[i:i + PARAM_BATCH])
        for i in range(0, len(changed), PARAM_BATCH):
            self.client.log_batch(self.run_id, tags=changed[i:i + PARAM_BATCH])

    def send(self, step: int, values: dict[str, float], times: dict[str, float],
             images: list[tuple[str, np.ndarray]]) -> None:
        from mlflow.entities import Metric

        metrics = [Metric(key, value, int(times.get(key, 0.0) * 1000), step) for key, value in values.items()]
        for i in range(0, len(metrics), BATCH):
            self.client.log_batch(self.run_id, metrics=metrics[i:i + BATCH])
        for tag, image in images:
            self.client.log_image(self.run_id, image[..., 0] if image.shape[-1] == 1 else image,
                                  artifact_file=f"images/{tag}/step_{step:07d}.png")

    def mark_redone(self, start_step: int, sent_step: int) -> None:
        self.client.set_tag(self.run_id, REDONE_TAG, f"{start_step + 1}-{sent_step}")

    def note(self) -> str:
        return f"run {self.run_id} at {self.uri}"

    def close(self, complete: bool) -> None:
        if self.client is not None and self.run_id:
            # KILLED: this launch ended before the run's end (a stop, a crash); the next one sets it RUNNING again.
            self.client.set_terminated(self.run_id, "FINISHED" if complete else "KILLED")


def log_artifact(state: TrackerState, paths: list[Path], timeout_s: float) -> None:
    """``paths`` under the artifact path 'model' of the training's MLflow run."""
    from mlflow.tracking import MlflowClient as Client

    mlflow_settings(state.extra.get("uri", ""), timeout_s)
    client = Client(tracking_uri=state.extra.get("uri"))
    for path in paths:
        client.log_artifact(state.run_id, str(path), "model")
