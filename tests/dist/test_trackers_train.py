"""The experiment trackers with the real packages and real processes (torchrun, gloo on CPU), every test with a hard
timeout. MLflow runs against a real tracking server (`mlflow server`, SQLite store) that this module starts on
loopback and stops by pid; W&B runs in offline mode and is read back from the files it wrote.

One training is shared by most tests: 2 processes, both trackers on, stopped by a SIGTERM at step 6 and resumed,
then SIGKILLed on rank 0 inside step 16, after its last checkpoint (step 12, or 8 while 12's background write had
not committed) with step 14 logged, and resumed on 1 process (an elastic resume) to step 20.
Faults come from HPCTRAIN_FAULT (hpctrain/fault/inject.py), so each step is deterministic."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections import Counter
from pathlib import Path

import pytest

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

from tests.conftest import kill_tree, read_jsonl, run_hpctrain

mlflow = pytest.importorskip("mlflow", reason="the mlflow extra is not installed (pip install -e '.[dev]')")
pytest.importorskip("wandb", reason="the wandb extra is not installed (pip install -e '.[dev]')")

from hpctrain.metrics.records import read_metrics  # noqa: E402
from tests.tracker_history import expected_history, mlflow_history, no_step_twice, the_mlflow_run, wandb_records  # noqa: E402

pytestmark = [pytest.mark.dist, pytest.mark.timeout(300)]

EXPERIMENT = "tracker_experiment:DigitsWithPictures"
MLFLOW_EXPERIMENT = "tracker_experiment-DigitsWithPictures"
SMALL = ["model.width=8", "model.norm=group", "train.global_batch_size=40", "train.micro_batch_size=10",
         "train.max_steps=20", "log.every_steps=2", "eval.every_steps=10", "log.outputs_every_steps=10",
         "ckpt.every_steps=4", "log.plots=false", "log.tensorboard=false", "data.num_workers=0"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Listener:
    """A loopback TCP port that counts who connects to it: W&B's server and proxy for the offline runs, so a
    connection is a byte W&B meant to send."""

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.requests: list[bytes] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            conn.settimeout(2)
            try:
                self.requests.append(conn.recv(200))  # its first bytes, for the failure message
            except OSError:
                self.requests.append(b"(connected, sent nothing)")
            conn.close()

    def close(self) -> None:
        self.sock.close()


@pytest.fixture(scope="module")
def mlflow_server(tmp_path_factory):
    """`mlflow server` with a SQLite store on 127.0.0.1:FREE_PORT; its process tree killed at the end, also when a
    test fails. Its background job runner (LLM evaluation jobs) is off: nothing here needs it, and it starts fast."""
    root = tmp_path_factory.mktemp("mlflow-server")
    port = free_port()
    log = open(root / "server.log", "w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "mlflow", "server", "--backend-store-uri", f"sqlite:///{root}/mlflow.db",
         "--artifacts-destination", str(root / "artifacts"), "--host", "127.0.0.1", "--port", str(port),
         "--workers", "1"],
        stdout=log, stderr=subprocess.STDOUT, start_new_session=True, cwd=root,
        env={**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"})
    uri = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 90
        while True:
            try:
                with urllib.request.urlopen(f"{uri}/health", timeout=1) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            assert proc.poll() is None, f"mlflow server exited:\n{(root / 'server.log').read_text()[-3000:]}"
            assert time.monotonic() < deadline, f"mlflow server not up in 90 s:\n{(root / 'server.log').read_text()}"
            time.sleep(0.2)
        yield uri
    finally:
        kill_tree(proc.pid)
        proc.wait(timeout=30)
        log.close()


def train(run_dir: Path, nproc: int, *extra: str, fault: str = "", env: dict | None = None, timeout: float = 150):
    env = {**(env or {}), **({"HPCTRAIN_FAULT": fault} if fault else {})}
    return run_hpctrain(["train", EXPERIMENT, f"run.dir={run_dir}", f"--nproc-per-node={nproc}", *SMALL, *extra],
                        timeout, env=env)


@pytest.fixture(scope="module")
def faulted(mlflow_server, tmp_path_factory):
    """The shared training (see the module's docstring); returns (run dir, what reached W&B's server, the log)."""
    run_dir = tmp_path_factory.mktemp("faulted") / "run"
    listener = Listener()
    bogus = f"http://127.0.0.1:{listener.port}"
    env = {"WANDB_BASE_URL": bogus, "HTTPS_PROXY": bogus, "HTTP_PROXY": bogus, "NO_PROXY": "127.0.0.1,localhost"}
    trackers = ['log.trackers=["mlflow","wandb"]', f"log.mlflow_uri={mlflow_server}", "log.wandb_offline=true",
                "log.wandb_project=hpctrain-test"]
    try:
        stopped = train(run_dir, 2, *trackers, fault="signal:rank=1:step=4", env=env)
        assert stopped.returncode == 75 and "stopped by SIGTERM at step 6" in stopped.stderr, stopped.output
        # rank 0 dies inside step 16: step 14 is logged after the last checkpoint (12, or 8 when the background
        # write of 12 had not committed yet), and lost with it
        killed = train(run_dir, 2, *trackers, fault="kill:rank=0:step=15", env=env)
        assert killed.returncode != 0 and "resumed from" in killed.stderr, killed.output
        done = train(run_dir, 1, *trackers, env=env)  # and elastic: the rest on 1 process
        assert done.returncode == 0, done.output
        assert "saved by 2 process(es)" in done.stderr, done.stderr
        assert "resumed from" in done.stderr and "tracker wandb failed" not in done.stderr, done.stderr
        assert "wandb sync --id" in done.stderr  # the end of the job's log says how to upload the offline run
    finally:
        listener.close()
    return run_dir, listener.requests, done.stderr


def test_mlflow_one_run_whose_history_is_metrics_jsonl_after_a_sigterm_and_a_sigkill(faulted, mlflow_server):
    run_dir = faulted[0]
    raw = Counter((r["split"], r["step"]) for r in read_jsonl(run_dir / "metrics.jsonl"))
    assert raw[("train", 14)] == 2  # the killed launch logged step 14, the resumed one again: the test means it
    client = mlflow.tracking.MlflowClient(tracking_uri=mlflow_server)
    run = the_mlflow_run(client, MLFLOW_EXPERIMENT)
    assert run.info.status == "FINISHED"
    assert json.loads((run_dir / "trackers" / "mlflow.json").read_text())["run_id"] == run.info.run_id
    history = mlflow_history(client, run)
    no_step_twice(history)
    assert {k: dict(v) for k, v in history.items()} == expected_history(run_dir)
    assert sorted(dict(history["train/loss"])) == list(range(2, 21, 2))
    assert {"train/samples_per_s", "train/data_wait_frac", "train/lr", "val/accuracy"} <= set(history)


def test_mlflow_gets_the_config_as_parameters_and_the_pictures_as_artifacts(faulted, mlflow_server):
    client = mlflow.tracking.MlflowClient(tracking_uri=mlflow_server)
    run = the_mlflow_run(client, MLFLOW_EXPERIMENT)
    params = run.data.params
    assert params["experiment"] == EXPERIMENT and params["model.width"] == "8" and params["train.max_steps"] == "20"
    assert params["log.trackers"] == "['mlflow', 'wandb']" and len(params) > 100  # every key of the resolved config
    pictures = [a.path for a in client.list_artifacts(run.info.run_id, "images/digits")]
    assert pictures == ["images/digits/step_0000010.png", "images/digits/step_0000020.png"]


def wandb_parts(run_dir: Path) -> tuple[str, list[Path]]:
    run_id = json.loads((run_dir / "trackers" / "wandb.json").read_text())["run_id"]
    return run_id, sorted((run_dir / "trackers" / "wandb").glob("offline-run-*"))


def test_wandb_offline_one_run_id_across_the_requeues_whose_history_is_metrics_jsonl(faulted):
    run_dir = faulted[0]
    run_id, parts = wandb_parts(run_dir)
    # One part per launch that opened W&B, all with the one id: the first and the last surely; the killed one if
    # its tracker thread had opened the run before the kill (it then holds only steps the resume does not redo).
    assert len(parts) in (2, 3) and all(p.name.endswith(f"-{run_id}") for p in parts), parts
    history: dict[str, dict[int, float]] = {}
    pictures, config = [], {}
    for part in parts:
        for record in wandb_records(next(part.glob("*.wandb"))):
            kind = record.WhichOneof("record_type")
            if kind == "run":
                assert record.run.run_id == run_id
                config |= {item.key: json.loads(item.value_json) for item in record.run.config.update}
            if kind != "history":
                continue
            step = record.history.step.num
            for item in record.history.item:
                key = item.key or "/".join(item.nested_key)  # 'train/loss' comes as a nested key
                if key.endswith("/_type") and json.loads(item.value_json) == "image-file":
                    pictures.append((key.rsplit("/", 1)[0], step))  # an image: TAG/_type, TAG/path, ...
                if key.startswith("_") or key.split("/")[0] == "digits":
                    continue
                assert step not in history.get(key, {}), f"{key}: step {step} twice"
                history.setdefault(key, {})[step] = json.loads(item.value_json)
    assert history == expected_history(run_dir)
    assert pictures == [("digits", 10), ("digits", 20)]
    resolved = tomllib.loads((run_dir / "config.toml").read_text())
    assert config["model.width"] == 8 and config["optim.lr"] == resolved["optim"]["lr"]


def test_wandb_offline_sends_nothing_over_the_network_and_says_how_to_sync(faulted):
    """(`hpctrain slurm status` printing the same line is tested on the Slurm cluster.)"""
    run_dir, requests, log = faulted
    assert requests == []  # W&B's server and proxy were a port that keeps what reaches it
    run_id, _ = wandb_parts(run_dir)
    assert f"wandb sync --id {run_id} --project hpctrain-test {run_dir}/trackers/wandb/offline-run-*-{run_id}" in log


def test_a_tracker_that_raises_or_a_server_that_is_down_never_stops_or_slows_the_training(tmp_path: Path):
    """MLflow pointed at a port nobody listens on, W&B online without an API key (it raises): the training ends as
    one without trackers does, each tracker warned once, and the end waited at most log.tracker_timeout_s."""
    plain = train(tmp_path / "plain", 1)
    assert plain.returncode == 0, plain.output
    down = train(tmp_path / "down", 1, 'log.trackers=["mlflow","wandb"]', f"log.mlflow_uri=http://127.0.0.1:{free_port()}",
                 "log.tracker_timeout_s=3", env={"HOME": str(tmp_path)})  # no ~/.netrc: no W&B key
    assert down.returncode == 0, down.output
    # MLflow's client retries a refused connection with a backoff: on a loaded machine the run may end first, and
    # its warning is then the end's (the wait given up after log.tracker_timeout_s) instead of the failure's.
    mlflow_warnings = down.stderr.count("tracker mlflow failed") + down.stderr.count("tracker mlflow did not finish")
    assert mlflow_warnings == 1 and down.stderr.count("tracker wandb failed") == 1, down.stderr
    assert sorted(r["step"] for r in read_metrics(tmp_path / "down" / "metrics.jsonl") if r["split"] == "train") == \
        list(range(2, 21, 2))

    def seconds(result) -> float:
        return float(result.stderr.split("done: step 20 in ")[1].split(" s")[0])

    assert seconds(down) < 2 * seconds(plain) + 3 + 5, (seconds(plain), seconds(down))


def test_a_sweep_with_mlflow_gives_one_run_per_point_grouped(tmp_path: Path, monkeypatch):
    sweep = tmp_path / "lr-sweep"
    res = run_hpctrain(["sweep", "submit", "digits", "--local", "--dir", str(sweep), "--grid", "optim.lr=1e-3,2e-3",
                        'log.trackers=["mlflow"]', *[s for s in SMALL if not s.startswith("log.outputs")],
                        "train.max_steps=4"], timeout=200)
    assert res.returncode == 0, res.output
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # the sweep's default store, SWEEP_DIR/mlruns
    client = mlflow.tracking.MlflowClient(tracking_uri=(sweep / "mlruns").as_uri())
    runs = client.search_runs([client.get_experiment_by_name("lr-sweep").experiment_id])
    by_name = {r.info.run_name: r for r in runs}
    assert sorted(by_name) == ["p000_lr=1e-3", "p001_lr=2e-3"]
    assert {r.data.tags["hpctrain.group"] for r in runs} == {"lr-sweep"}
    assert by_name["p000_lr=1e-3"].data.params["optim.lr"] == "0.001"
    assert by_name["p001_lr=2e-3"].data.params["optim.lr"] == "0.002"
    assert all(sorted(m.step for m in client.get_metric_history(r.info.run_id, "train/loss")) == [2, 4] for r in runs)


def test_the_export_goes_to_the_same_tracker_runs_as_a_model_artifact(faulted, mlflow_server, tmp_path: Path):
    """`hpctrain export --to-trackers`, on a copy of the run dir (W&B's new offline part lands there, the shared run
    dir keeps its three)."""
    import shutil

    copy = tmp_path / "run"
    shutil.copytree(faulted[0], copy)
    before = len(wandb_parts(copy)[1])
    res = run_hpctrain(["export", str(copy), "--out", str(copy / "model.safetensors"), "--to-trackers"], timeout=120)
    assert res.returncode == 0, res.output
    assert "export logged to mlflow" in res.stderr and "export logged to wandb" in res.stderr, res.stderr
    client = mlflow.tracking.MlflowClient(tracking_uri=mlflow_server)
    run = the_mlflow_run(client, MLFLOW_EXPERIMENT)
    assert [a.path for a in client.list_artifacts(run.info.run_id, "model")] == ["model/model.safetensors",
                                                                               "model/model.toml"]
    run_id, parts = wandb_parts(copy)
    kinds = [r.WhichOneof("record_type") for r in wandb_records(next(parts[-1].glob("*.wandb")))]
    assert len(parts) == before + 1 and "artifact" in kinds, kinds
