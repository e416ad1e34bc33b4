"""The experiment trackers' pure parts and their sink with a stand-in client (no process, no network): the config
as parameters, which records a launch sends and when (the hold-back to the committed checkpoint, the catch-up from
metrics.jsonl, the marked rewind), a tracker that raises or hangs, the refusal of a missing package, the sweep's
grouping. tests/dist/test_trackers_train.py runs the real wandb and mlflow packages."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from hpctrain.config.load import flat_config
from hpctrain.config.validate import ConfigError
from hpctrain.errors import UserError
from hpctrain.metrics.trackers import build, wandb_client
from hpctrain.metrics.trackers.sink import StartPlan, TrackerSink, decide_start, tracker_values
from hpctrain.metrics.trackers.state import TrackerState, read_state, write_state
from hpctrain.resolution import resolve_config


class Recorder:
    """A tracker that keeps what it is sent; ``fail_at``: the step whose send raises; ``delay``: seconds per send."""

    name = "fake"

    def __init__(self, fail_at: int = 0, delay: float = 0.0, fail_open: bool = False) -> None:
        self.steps: dict[int, dict[str, float]] = {}
        self.images: list[tuple[int, str]] = []
        self.redone: tuple[int, int] | None = None
        self.closed: bool | None = None
        self.fail_at, self.delay, self.fail_open = fail_at, delay, fail_open

    def open(self, state: TrackerState) -> TrackerState:
        if self.fail_open:
            raise ConnectionError("tracking server at 127.0.0.1:9 refused the connection")
        return TrackerState(uid=state.uid, run_id=state.run_id or "run-1", sent_step=state.sent_step)

    def send(self, step, values, times, images) -> None:
        time.sleep(self.delay)
        if step == self.fail_at:
            raise RuntimeError("the tracker broke")
        assert step not in self.steps, f"step {step} sent twice"
        self.steps[step] = dict(values)
        self.images += [(step, tag) for tag, _ in images]

    def mark_redone(self, start_step, sent_step) -> None:
        self.redone = (start_step, sent_step)

    def close(self, complete: bool) -> None:
        self.closed = complete

    def note(self) -> str:
        return ""


def _sink(tmp_path: Path, client: Recorder, start: int = 0, total: int = 20, durable=None, timeout: float = 5.0):
    return TrackerSink(client, tmp_path, start, total, durable, timeout)


def _train(step: int, loss: float = 1.0) -> dict:
    return {"step": step, "split": "train", "time": 1000.0 + step, "loss": loss, "epoch": 0}


def test_the_config_is_flattened_to_dotted_parameters():
    cfg = resolve_config("digits", None, ["optim.lr=0.002", "model.width=8"])[1]
    params = flat_config(cfg)
    assert params["optim.lr"] == 0.002 and params["model.width"] == 8 and params["experiment"] == "digits"
    assert params["train.global_batch_size"] == cfg.train.global_batch_size
    assert build._param(params["optim.betas"]) == "[0.9, 0.999]"  # lists as text: both trackers take it


def test_records_become_tracker_keys_and_events_none():
    assert tracker_values({"step": 3, "split": "val", "time": 1.0, "epoch": 1, "accuracy": 0.5, "loss": 2}) == \
        {"val/accuracy": 0.5, "val/loss": 2.0}
    assert tracker_values({"step": 3, "split": "resume", "checkpoint": "step_3", "world_size": 2}) == {}


@pytest.mark.parametrize("sent, start, plan", [
    (0, 0, StartPlan(skip_through=0)),  # a new training
    (10, 10, StartPlan(skip_through=10)),  # a clean resume: everything up to the checkpoint is there
    (8, 12, StartPlan(catch_up=(8, 12), skip_through=8)),  # the tracker missed 9..12 (killed, or down)
    (16, 12, StartPlan(skip_through=16, redone=True)),  # resumed from an older checkpoint than the newest
])
def test_the_rewind_decision(sent: int, start: int, plan: StartPlan):
    assert decide_start(sent, start) == plan


def test_records_wait_for_the_checkpoint_that_holds_them(tmp_path: Path):
    client, durable = Recorder(), [0]
    sink = _sink(tmp_path, client, durable=lambda: durable[0])
    for step in range(1, 8):
        sink.write(_train(step))
    time.sleep(1.5)
    assert client.steps == {}  # no checkpoint yet: a crash would redo them all
    durable[0] = 5
    sink.write(_train(8))
    deadline = time.monotonic() + 5
    while len(client.steps) < 5 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert sorted(client.steps) == [1, 2, 3, 4, 5]
    durable[0] = 8
    sink.close()  # the launch ends before the run's end: its last step is kept back for the next launch
    assert sorted(client.steps) == list(range(1, 8)) and client.closed is False
    assert read_state(tmp_path, "fake").sent_step == 7


def test_the_next_launch_sends_the_kept_step_whole_with_what_it_adds(tmp_path: Path):
    """A stop at step 8 skipped the validation due there; the resumed launch makes it first, and step 8 reaches
    the tracker once, with both records."""
    first = Recorder()
    sink = _sink(tmp_path, first, durable=lambda: 8)
    lines = [_train(s) for s in range(1, 9)]
    for record in lines:
        sink.write(record)
    sink.close()
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    second = Recorder()
    sink = _sink(tmp_path, second, start=8, durable=lambda: 20)
    sink.write({"step": 8, "split": "val", "time": 2000.0, "accuracy": 0.75})
    for step in range(9, 21):
        sink.write(_train(step))
    sink.close()
    assert sorted(first.steps) == list(range(1, 8)) and sorted(second.steps) == list(range(8, 21))
    assert second.steps[8] == {"train/loss": 1.0, "val/accuracy": 0.75}
    assert second.closed is True  # the run's last step was sent


def test_a_killed_launchs_unsent_records_come_from_metrics_jsonl(tmp_path: Path):
    write_state(tmp_path, "fake", TrackerState(run_id="run-1", sent_step=4))
    lines = [_train(s, loss=s / 10) for s in range(1, 15)]  # the dead launch logged up to 14; its checkpoint: 12
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    client = Recorder()
    sink = _sink(tmp_path, client, start=12, durable=lambda: 20)
    for step in range(13, 21):
        sink.write(_train(step, loss=9.0))  # the resumed launch's values for 13 and 14 win
    sink.close()
    assert sorted(client.steps) == list(range(5, 21))
    assert client.steps[12] == {"train/loss": 1.2} and client.steps[13] == {"train/loss": 9.0}


def test_a_resume_behind_what_the_tracker_has_is_marked_and_sends_no_step_twice(tmp_path: Path, caplog):
    write_state(tmp_path, "fake", TrackerState(run_id="run-1", sent_step=16))
    client = Recorder()
    sink = _sink(tmp_path, client, start=12, durable=lambda: 20)
    for step in range(13, 21):
        sink.write(_train(step))
    sink.close()
    assert sorted(client.steps) == [17, 18, 19, 20] and client.redone == (12, 16)
    assert "steps 13-16 keep the values of the earlier launch" in caplog.text


def test_a_tracker_that_raises_warns_once_and_never_reaches_the_training(tmp_path: Path, caplog):
    client = Recorder(fail_at=3)
    sink = _sink(tmp_path, client)
    for step in range(1, 21):
        sink.write(_train(step))
        sink.write_image("samples", step, np.zeros((2, 2, 3), np.uint8))
    sink.close()
    assert sorted(client.steps) == [1, 2] and sink.failed.startswith("RuntimeError: the tracker broke")
    assert caplog.text.count("tracker fake failed") == 1
    assert read_state(tmp_path, "fake").sent_step == 2  # the next launch sends 3.. from metrics.jsonl


def test_a_tracker_that_cannot_connect_warns_once(tmp_path: Path, caplog):
    sink = _sink(tmp_path, Recorder(fail_open=True))
    sink.write(_train(1))
    sink.close()
    assert "refused the connection" in caplog.text and caplog.text.count("failed") == 1


def test_a_tracker_that_fails_after_the_end_gave_up_on_it_does_not_warn_again(tmp_path: Path, caplog):
    """The end waits log.tracker_timeout_s and says so; the daemon thread's own failure, coming while the process
    exits, is the same tracker down and is not said a second time (seen with MLflow's retries on a loaded VM)."""
    class SlowToRefuse(Recorder):
        def open(self, state):
            time.sleep(1.0)
            raise ConnectionRefusedError("refused the connection")

    sink = _sink(tmp_path, SlowToRefuse(), timeout=0.3)
    sink.write(_train(1))
    sink.close()
    sink.thread.join(10)
    assert not sink.thread.is_alive() and sink.failed.startswith("ConnectionRefusedError")
    assert "did not finish within log.tracker_timeout_s=0.3 s" in caplog.text
    assert "tracker fake failed" not in caplog.text


def test_a_slow_tracker_costs_the_training_nothing_and_the_end_waits_a_bounded_time(tmp_path: Path, caplog):
    client = Recorder(delay=0.5)
    sink = _sink(tmp_path, client, timeout=1.0)
    started = time.perf_counter()
    for step in range(1, 201):
        sink.write(_train(step))
    assert time.perf_counter() - started < 0.2  # 200 records: only queue puts on the training's side
    sink.close()
    assert time.perf_counter() - started < 3.0
    assert "did not finish within log.tracker_timeout_s=1 s" in caplog.text


def test_a_full_queue_drops_and_says_from_which_step(tmp_path: Path, caplog, monkeypatch):
    from hpctrain.metrics.trackers import sink as sink_module

    gate = threading.Event()

    class Stuck(Recorder):
        def open(self, state):
            gate.wait(5)
            return super().open(state)

    monkeypatch.setattr(sink_module, "QUEUE_SIZE", 5)
    client = Stuck()
    sink = _sink(tmp_path, client)
    for step in range(1, 12):
        sink.write(_train(step))
    gate.set()
    sink.close()
    assert "records from step 6 on are not sent in this launch" in caplog.text
    assert sorted(client.steps) == [1, 2, 3, 4, 5]  # every step before the first dropped one is complete


def test_a_missing_tracker_package_is_refused_naming_the_extra(monkeypatch):
    real = build.importlib.util.find_spec
    monkeypatch.setattr(build.importlib.util, "find_spec", lambda name: None if name == "wandb" else real(name))
    with pytest.raises(UserError) as err:
        build.check_installed(("mlflow", "wandb"))
    assert "the wandb package is not installed" in str(err.value) and "pip install 'hpctrain[wandb]'" in err.value.hint
    build.check_installed(("tensorboard",))  # nothing to import for it here


def test_the_training_preflight_refuses_it_before_any_process(monkeypatch, tmp_path: Path):
    from hpctrain.commands.train import preflight

    monkeypatch.setattr(build.importlib.util, "find_spec", lambda name: None)
    cfg = resolve_config("digits", None, [f"run.dir={tmp_path / 'run'}", 'log.trackers=["mlflow"]'])[1]
    with pytest.raises(UserError, match="hpctrain\\[mlflow\\]"):
        preflight(cfg, 1)


@pytest.mark.parametrize("setting, message", [
    ('log.trackers=["comet"]', "unknown tracker(s) ['comet']"),
    ('log.trackers=["wandb","wandb"]', "named twice"),
    ("log.tracker_timeout_s=0", "must be positive"),
])
def test_bad_tracker_settings_name_their_key(setting: str, message: str):
    with pytest.raises(ConfigError, match="log.tracker") as err:
        resolve_config("digits", None, [setting])
    assert message in str(err.value)


def test_a_sweep_point_joins_the_sweeps_group_and_store(tmp_path: Path):
    from hpctrain.sweep.spec import grouped

    plain = resolve_config("digits", None, [])[1]
    assert grouped(plain, tmp_path / "lr-sweep") is plain  # without trackers: the config as before
    cfg = resolve_config("digits", None, ['log.trackers=["mlflow"]'])[1]
    point = grouped(cfg, tmp_path / "lr-sweep")
    assert point.log.tracker_group == "lr-sweep" and point.log.mlflow_uri == (tmp_path / "lr-sweep" / "mlruns").as_uri()
    named = resolve_config("digits", None, ['log.trackers=["wandb"]', "log.tracker_group=mine"])[1]
    assert grouped(named, tmp_path / "lr-sweep").log.tracker_group == "mine"


def test_the_offline_sync_command_names_every_launchs_part(tmp_path: Path):
    state = TrackerState(run_id="abc123", extra={"mode": "offline", "project": "digits", "entity": "",
                                                 "dir": str(tmp_path / "a b" / "trackers" / "wandb")})
    assert wandb_client.sync_command(state) == \
        f"wandb sync --id abc123 --project digits '{tmp_path}/a b/trackers/wandb'/offline-run-*-abc123"
    assert wandb_client.sync_command(TrackerState(run_id="x", extra={"mode": "online"})) == ""
    write_state(tmp_path, "wandb", state)
    assert build.offline_sync_command(tmp_path) == wandb_client.sync_command(state)


def test_a_fresh_start_in_a_used_run_dir_sets_the_tracker_runs_aside(tmp_path: Path):
    """No checkpoint to resume: the earlier attempt's tracker runs are not continued (a new training, a new run)."""
    from hpctrain.train.rundir import set_aside_records

    write_state(tmp_path, "mlflow", TrackerState(run_id="earlier", sent_step=4))
    (tmp_path / "metrics.jsonl").write_text(json.dumps(_train(4)) + "\n")
    moved = set_aside_records(tmp_path)
    assert read_state(tmp_path, "mlflow") is None
    assert {p.name.split(".")[0] for p in moved} == {"metrics", "trackers"}
    kept = next(p for p in moved if p.name.startswith("trackers."))
    assert json.loads((kept / "mlflow.json").read_text())["run_id"] == "earlier"  # kept, as metrics.jsonl is


def test_mlflow_in_another_store_gets_the_whole_run_so_far_and_a_changed_setting_is_a_tag(tmp_path: Path, monkeypatch):
    """With the real MLflow client on two file stores: a launch whose log.mlflow_uri changed starts a run in the new
    store and sends it everything metrics.jsonl has up to its start; the old store's run stays as it was."""
    pytest.importorskip("mlflow")
    from mlflow.tracking import MlflowClient

    from hpctrain.metrics.trackers.mlflow_client import MlflowClient as Tracker

    # What mlflow_settings would set in this process, set here so that the test leaves the environment as it was.
    for name, value in {"MLFLOW_ALLOW_FILE_STORE": "true", "MLFLOW_HTTP_REQUEST_TIMEOUT": "5",
                        "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "1", "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1",
                        "MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT": "true"}.items():
        monkeypatch.setenv(name, value)
    lines = [_train(s, loss=s / 10) for s in range(1, 9)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    stores = [(tmp_path / name).as_uri() for name in ("a", "b")]

    def launch(uri: str, start: int, steps: range, lr: float = 0.1) -> None:
        client = Tracker(uri=uri, experiment="exp", run_name="run", group="", tags=(), params={"optim.lr": lr},
                         start_step=start, timeout_s=5)
        sink = _sink(tmp_path, client, start=start, total=8, durable=lambda: 8)
        for step in steps:
            sink.write(_train(step, loss=step / 10))
        sink.close()
        assert not sink.failed, sink.failed

    launch(stores[0], 0, range(1, 5))
    launch(stores[1], 4, range(5, 9))
    histories = []
    for uri in stores:
        client = MlflowClient(tracking_uri=uri)
        (run,) = client.search_runs([client.get_experiment_by_name("exp").experiment_id])
        histories.append(sorted(m.step for m in client.get_metric_history(run.info.run_id, "train/loss")))
    assert histories == [[1, 2, 3], list(range(1, 9))]  # 4 was kept back for the next launch, which went elsewhere
    launch(stores[1], 8, range(0), lr=0.2)  # a resume with a changed setting: MLflow's params cannot change
    client = MlflowClient(tracking_uri=stores[1])
    (run,) = client.search_runs([client.get_experiment_by_name("exp").experiment_id])
    assert run.data.params["optim.lr"] == "0.1" and run.data.tags["hpctrain.changed.optim.lr"] == "0.2 from step 8 (was 0.1)"
