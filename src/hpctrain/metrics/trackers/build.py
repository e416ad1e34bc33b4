"""The trackers a config names (log.trackers), as sinks; the check that their packages are installed, made before
any process starts; and what the commands read back from RUN_DIR/trackers (W&B's sync command, the export's
artifact)."""

from __future__ import annotations

import importlib.util
import logging
import re
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from hpctrain.config.load import flat_config
from hpctrain.errors import UserError
from hpctrain.metrics.trackers import mlflow_client, wandb_client
from hpctrain.metrics.trackers.sink import TrackerSink
from hpctrain.metrics.trackers.state import read_state

if TYPE_CHECKING:
    from hpctrain.config.schema import RunConfig

log = logging.getLogger("hpctrain")

PACKAGES = {"wandb": ("wandb", "wandb"), "mlflow": ("mlflow", "mlflow")}
"""Tracker -> (the module it imports, hpctrain's extra that installs it)."""


def check_installed(trackers: tuple[str, ...]) -> None:
    """UserError naming the extra for a tracker whose package is missing (before any process starts)."""
    for name in trackers:
        module, extra = PACKAGES.get(name, ("", ""))
        if module and importlib.util.find_spec(module) is None:
            raise UserError(f"log.trackers names {name}, and the {module} package is not installed here",
                            f"pip install 'hpctrain[{extra}]' (or pip install {module}), or drop {name} from "
                            "log.trackers.")


def build_tracker_sinks(cfg: "RunConfig", start_step: int, total_steps: int,
                        durable_step: Callable[[], int] | None) -> list[TrackerSink]:
    """One sink per tracker of log.trackers (tensorboard is the TensorBoard sink's, not here)."""
    run_dir, c = Path(cfg.run_dir), cfg.log
    params = {key: _param(value) for key, value in flat_config(cfg).items()}
    run_name = cfg.run.name or run_dir.resolve().name  # a sweep's points: their own names, not the experiment's
    clients = []
    if "wandb" in c.trackers:
        clients.append(wandb_client.WandbClient(
            run_dir=run_dir, project=c.wandb_project or _name(cfg.experiment), entity=c.wandb_entity,
            offline=c.wandb_offline, run_name=run_name, group=c.tracker_group, tags=c.tracker_tags,
            params=params, init_timeout_s=c.tracker_timeout_s))
    if "mlflow" in c.trackers:
        clients.append(mlflow_client.MlflowClient(
            uri=c.mlflow_uri or mlflow_client.default_uri(run_dir),
            experiment=c.mlflow_experiment or c.tracker_group or _name(cfg.experiment), run_name=run_name,
            group=c.tracker_group, tags=c.tracker_tags, params=params, start_step=start_step,
            timeout_s=c.tracker_timeout_s))
    return [TrackerSink(client, run_dir, start_step, total_steps, durable_step, c.tracker_timeout_s)
            for client in clients]


def _name(experiment: str) -> str:
    """An experiment as a W&B project or MLflow experiment name: 'mymodule:MyExperiment' -> 'mymodule-MyExperiment'."""
    return re.sub(r"[^A-Za-z0-9_.-]+", "-", experiment).strip("-") or "hpctrain"


def _param(value):
    """A config value as both trackers take it: numbers, strings and booleans as they are, lists as text."""
    return value if isinstance(value, (int, float, str, bool)) else str(value)


def offline_sync_command(run_dir: Path) -> str:
    """The `wandb sync` command for a run dir whose W&B run is offline; '' when there is none."""
    state = read_state(run_dir, wandb_client.NAME)
    return wandb_client.sync_command(state) if state is not None else ""


def log_model_artifact(run_dir: Path, paths: list[Path], trackers: tuple[str, ...], timeout_s: float) -> list[str]:
    """The files of an export as one model artifact of the run dir's tracker runs (hpctrain export --to-trackers);
    the trackers that got it. A tracker the run never opened is an error that says so; one that fails warns, the
    export stands."""
    done = []
    for name in (t for t in trackers if t in PACKAGES):
        state = read_state(run_dir, name)
        if state is None or not state.run_id:
            raise UserError(f"{run_dir} has no {name} run (RUN_DIR/trackers/{name}.json is missing or has no run id)",
                            "the export is written; a run that trained with the tracker has the file.")
        check_installed((name,))
        try:
            if name == wandb_client.NAME:
                wandb_client.log_artifact(state, run_dir, paths, _name(f"{run_dir.resolve().name}-model"), timeout_s)
            else:
                mlflow_client.log_artifact(state, paths, timeout_s)
            done.append(name)
        except Exception as err:  # noqa: BLE001 - the export is written; the tracker's failure is said
            log.warning("the export could not be logged to %s (%s: %s); it is at %s", name, type(err).__name__,
                        str(err).splitlines()[0][:300] if str(err) else "", paths[0].parent)
    return done
