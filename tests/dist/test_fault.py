"""Fault injection with real processes (torchrun, gloo on CPU). Every test has a hard timeout.

Faults come from HPCTRAIN_FAULT (see hpctrain/fault/inject.py): real signals a rank sends
itself, real exceptions, a real SIGKILL, a real sleep, at a chosen rank and step, so each
test is deterministic."""

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from tests.conftest import final_params, read_jsonl, run_hpctrain, same_params, train_losses

pytestmark = [pytest.mark.dist, pytest.mark.timeout(300)]

SMALL = ["model.width=8", "model.norm=group", "train.global_batch_size=40", "train.micro_batch_size=10",
         "log.every_steps=1", "log.plots=false", "log.tensorboard=false", "optim.lr=1e-3", "optim.warmup_steps=0"]


def train(run_dir: Path, nproc: int, *extra: str, fault: str = "", expect: int = 0, timeout: float = 150, env=None):
    env = {**(env or {}), **({"HPCTRAIN_FAULT": fault} if fault else {})}
    result = run_hpctrain(["train", "digits", f"run.dir={run_dir}", f"--nproc-per-node={nproc}", *SMALL, *extra],
                          timeout, env=env)
    assert result.returncode == expect, result.output
    return result


def checkpoints(run_dir: Path) -> list[str]:
    return sorted(p.name for p in (run_dir / "checkpoints").glob("step_*"))


@pytest.fixture(scope="module")
def straight(tmp_path_factory) -> Path:
    """The uninterrupted reference: 2 processes, 24 steps, one loader worker per rank."""
    run_dir = tmp_path_factory.mktemp("straight")
    train(run_dir, 2, "train.max_steps=24", "data.num_workers=1")
    return run_dir


@pytest.mark.parametrize("rank, sig", [(1, "SIGTERM"), (0, "SIGUSR2")])
def test_signal_to_one_rank_stops_all_at_one_step_and_resume_is_exact(tmp_path: Path, straight: Path, rank, sig):
    run_dir = tmp_path / "run"
    # The signal lands inside step 9 on one rank; the vote cast at boundary 9 is read at boundary 10.
    stopped = train(run_dir, 2, "train.max_steps=24", "data.num_workers=1",
                    fault=f"signal:rank={rank}:step=8:signal={sig}", expect=75)
    assert f"stopped by {sig} at step 10 with a checkpoint" in stopped.stderr
    assert "all 2 workers stopped after a checkpoint" in stopped.stderr
    assert checkpoints(run_dir) == ["step_00000010"]
    beats = {b["rank"]: b for b in map(json.loads, map(Path.read_text, (run_dir / "heartbeat").glob("rank_*.json")))}
    assert {(b["step"], b["phase"]) for b in beats.values()} == {(10, "stopped")}

    resumed = train(run_dir, 2, "train.max_steps=24", "data.num_workers=1")
    assert "at step 10" in resumed.stderr
    assert train_losses(run_dir) == train_losses(straight)
    assert same_params(final_params(run_dir), final_params(straight))


@pytest.mark.parametrize("before, after", [(2, 1), (1, 2), (2, 4)])
def test_elastic_resume_on_another_world_size(tmp_path: Path, straight: Path, before, after):
    run_dir = tmp_path / "run"
    train(run_dir, before, "train.max_steps=24", "data.num_workers=1", "train.stop_at_step=12")
    resumed = train(run_dir, after, "train.max_steps=24", "data.num_workers=1")
    assert f"saved by {before} process(es)" in resumed.stderr
    assert f"micro 10 x {after} ranks x {4 // after} accumulation" in resumed.stderr
    assert "re-seeded from (seed, rank, step)" in resumed.stderr  # the documented caveat, said in the log
    got, want = train_losses(run_dir), train_losses(straight)
    assert sorted(got) == sorted(want) == list(range(1, 25))
    for step in want:
        assert got[step] == pytest.approx(want[step], rel=1e-5), step


def test_resume_with_another_global_batch_stops_unless_told_to_restart_the_epoch(tmp_path: Path):
    """The saved data position counts global batches of 40: with 20 it would point at other samples. So exit 2
    before launch, nothing written; with ckpt.on_batch_change=restart_epoch the epoch starts again, said in the log."""
    run_dir = tmp_path / "run"
    train(run_dir, 2, "train.max_steps=24", "train.stop_at_step=6")
    before = {p: p.stat().st_mtime_ns for p in run_dir.rglob("*")}
    refused = train(run_dir, 2, "train.max_steps=24", "train.global_batch_size=20", expect=2)
    assert "was saved with 40, this launch has 20" in refused.stderr and "6 steps into epoch 0" in refused.stderr
    assert "ckpt.on_batch_change=restart_epoch" in refused.stderr and "starting 2 processes" not in refused.stderr
    assert {p: p.stat().st_mtime_ns for p in run_dir.rglob("*")} == before

    resumed = train(run_dir, 2, "train.max_steps=24", "train.global_batch_size=20", "ckpt.on_batch_change=restart_epoch")
    assert "changed from 40 to 20 (ckpt.on_batch_change=restart_epoch): epoch 0 starts again" in resumed.stderr
    assert "resumed from" in resumed.stderr and "at step 6 (epoch 0, step 0 of it)" in resumed.stderr
    assert sorted(train_losses(run_dir)) == list(range(1, 25))
    final = json.loads((run_dir / "checkpoints" / "step_00000024" / "state.json").read_text())
    assert (final["global_batch_size"], final["step_in_epoch"]) == (20, 18)


def flip_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def test_corrupt_latest_checkpoint_falls_back_and_says_so(tmp_path: Path, straight: Path):
    run_dir = tmp_path / "run"
    train(run_dir, 2, "train.max_steps=24", "data.num_workers=1", "ckpt.every_steps=4", "train.stop_at_step=8")
    assert checkpoints(run_dir) == ["step_00000004", "step_00000008"]
    flip_byte(run_dir / "checkpoints" / "step_00000008" / "dcp" / "__0_0.distcp")
    resumed = train(run_dir, 2, "train.max_steps=24", "data.num_workers=1", "ckpt.every_steps=4")
    assert "skipping checkpoint" in resumed.stderr and "step_00000008: dcp/__0_0.distcp: checksum mismatch" in resumed.stderr
    assert "resumed from" in resumed.stderr and "step_00000004 at step 4" in resumed.stderr
    assert train_losses(run_dir) == train_losses(straight)  # steps 5-8 were redone the same way


def test_only_corrupt_checkpoints_is_an_error_that_deletes_nothing(tmp_path: Path):
    run_dir = tmp_path / "run"
    train(run_dir, 1, "train.max_steps=6", "train.stop_at_step=3")
    model = run_dir / "checkpoints" / "step_00000003" / "dcp" / "__0_0.distcp"
    model.write_bytes(model.read_bytes()[:100])  # truncated
    before = sorted(str(p) for p in run_dir.rglob("*"))
    failed = train(run_dir, 2, "train.max_steps=6", expect=2)
    assert "none is valid" in failed.stderr and "truncated" in failed.stderr and "nothing was deleted" in failed.stderr
    assert sorted(str(p) for p in run_dir.rglob("*")) == before


@pytest.mark.parametrize("nproc, action", [(2, "crash"), (2, "kill"), (4, "kill")])
def test_a_dying_rank_ends_the_job_quickly_and_is_named(tmp_path: Path, nproc, action):
    started = time.monotonic()
    result = train(tmp_path, nproc, "train.max_steps=50", fault=f"{action}:rank=1:step=3", expect=1 if action == "crash" else 137)
    seconds = time.monotonic() - started
    print(f"{action} of rank 1 of {nproc}: job ended after {seconds:.1f} s (including start-up)")
    assert seconds < 60
    assert "worker rank 1 (local rank 1" in result.stderr and "failed first" in result.stderr
    if action == "crash":
        assert "RuntimeError: injected crash on rank 1 at step 3" in result.stderr.splitlines()[-1]
    else:
        assert "killed by SIGKILL" in result.stderr


def test_a_hung_rank_is_reported_and_the_job_ends(tmp_path: Path):
    """Rank 1 sleeps inside step 4's forward. The watchdog reports it after 4 s; rank 0's collective
    times out after 15 s; torchrun then stops rank 1 (SIGKILL 30 s after SIGTERM, which a stuck rank cannot act on)."""
    started = time.monotonic()
    result = train(tmp_path, 2, "train.max_steps=50", "fault.hang_timeout_s=4", "fault.heartbeat_every_s=1",
                   "dist.timeout_s=15", fault="hang:rank=1:step=3:seconds=600", expect=1, timeout=150)
    seconds = time.monotonic() - started
    print(f"hang: job ended after {seconds:.1f} s")
    assert seconds < 100
    report = json.loads((tmp_path / "heartbeat" / "hang_report.json").read_text())
    first = report["stuck"][0]
    assert (first["rank"], first["phase"], first["step"]) == (1, "forward", 3)
    assert "rank 1 on" in result.stderr and "phase 'forward' at step 3" in result.stderr
    stack = (tmp_path / "heartbeat" / "stuck_rank_1.txt").read_text()
    assert "inject.py" in stack and "time.sleep" in stack


class _Hook(BaseHTTPRequestHandler):
    received: list = []

    def do_POST(self):  # noqa: N802 - http.server's name
        body = self.rfile.read(int(self.headers["Content-Length"]))
        type(self).received.append((self.path, json.loads(body)))
        self.send_response(200)
        self.end_headers()

    def log_message(self, *args):
        pass


@pytest.fixture
def webhook():
    """A webhook receiver on 127.0.0.1 only; stopped when the test ends."""
    _Hook.received = []
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Hook)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/hooks/secret-token-4711", _Hook.received
    finally:
        server.shutdown()
        server.server_close()


def assert_secret_absent(result, run_dir: Path) -> None:
    assert "secret-token-4711" not in result.output
    for path in run_dir.rglob("*"):
        if path.is_file():
            assert b"secret-token-4711" not in path.read_bytes(), path


def test_alerts_on_failure_and_requeue(tmp_path: Path, webhook):
    url, received = webhook
    env = {"HPCTRAIN_ALERT_WEBHOOK": url}
    crashed = train(tmp_path / "a", 2, "train.max_steps=20", fault="crash:rank=1:step=2", expect=1, env=env)
    assert [b["event"] for _, b in received] == ["failure"]  # one alert for the job, from the launcher
    path, body = received[0]
    assert path == "/hooks/secret-token-4711"
    assert body["rank"] == 1 and body["exit_code"] == 1 and "injected crash" in body["detail"]
    assert body["run"] == "digits" and body["host"] and "last_step" in body
    assert_secret_absent(crashed, tmp_path / "a")

    received.clear()
    stopped = train(tmp_path / "b", 2, "train.max_steps=20", fault="signal:rank=1:step=2", expect=75, env=env)
    assert [b["event"] for _, b in received] == ["requeue"]
    body = received[0][1]
    assert body["exit_code"] == 75 and body["last_step"] == 4 and "SIGTERM" in body["detail"]
    assert any("stopped by SIGTERM" in line for line in body["log_tail"])
    assert_secret_absent(stopped, tmp_path / "b")


def test_slack_format_and_completion_event(tmp_path: Path, webhook):
    url, received = webhook
    done = train(tmp_path, 1, "train.max_steps=3", 'alert.events=["complete"]', "alert.format=slack",
                 env={"HPCTRAIN_ALERT_WEBHOOK": url})
    assert len(received) == 1 and list(received[0][1]) == ["text"]
    assert "COMPLETE" in received[0][1]["text"] and "last step 3" in received[0][1]["text"]
    assert_secret_absent(done, tmp_path)


def test_dead_webhook_does_not_fail_the_run(tmp_path: Path):
    url = "http://127.0.0.1:9/hooks/secret-token-4711"  # the discard port: nothing listens
    done = train(tmp_path, 2, "train.max_steps=3", 'alert.events=["complete"]', env={"HPCTRAIN_ALERT_WEBHOOK": url})
    assert "alert 'complete' to webhook at 127.0.0.1 failed" in done.stderr
    assert_secret_absent(done, tmp_path)


@pytest.mark.parametrize("source", ["file with a second line", "variable with a space"])
def test_a_malformed_webhook_is_refused_at_start_and_never_shown(tmp_path: Path, webhook, source):
    """Left to the requeue alert, such a URL made rank 0 raise (http.client.InvalidURL, quoting the URL) before
    `scontrol requeue`: exit 1 instead of 75, and the URL in the log and the launcher's failure line."""
    url, received = webhook
    hook = tmp_path / "hook"  # outside the run dir, which must not hold the secret
    hook.write_text(url + "\nhttps://second.example.org/x\n")
    extra, env = ([f"alert.webhook_file={hook}"], {}) if "file" in source else ([], {"HPCTRAIN_ALERT_WEBHOOK": url + " x"})
    refused = train(tmp_path / "run", 2, "train.max_steps=20", *extra, fault="signal:rank=1:step=2", expect=2, env=env)
    assert ("line break" if "file" in source else "a space") in refused.stderr
    assert "HINT:" in refused.stderr and not received
    assert_secret_absent(refused, tmp_path / "run")


def test_plain_single_process_stops_on_sigterm_with_a_checkpoint(tmp_path: Path):
    """No launcher at all: the handler in the one process, the same stop at a step boundary."""
    result = train(tmp_path, 1, "train.max_steps=20", fault="signal:rank=0:step=4", expect=75)
    assert "stopped by SIGTERM at step 6 with a checkpoint" in result.stderr
    assert checkpoints(tmp_path) == ["step_00000006"]
    assert "resume me" in result.stderr


def test_time_based_checkpoints_are_agreed_by_all_ranks(tmp_path: Path):
    """ckpt.every_minutes from rank 0's clock, through the vote: saves happen, on every rank alike (no hang)."""
    result = train(tmp_path, 2, "train.max_steps=30", "ckpt.every_minutes=0.001", "ckpt.keep_last=100",
                   "ckpt.every_steps=0")
    saved = checkpoints(tmp_path)
    assert len(saved) > 2 and saved[-1] == "step_00000030"  # time-based ones, then the final one
    assert result.stderr.count("saved checkpoint") == len(saved)


def test_a_slow_checkpoint_write_waits_on_the_control_plane_not_the_training_timeout(tmp_path: Path):
    """Rank 0 takes 12 s in each checkpoint save (a slow shared file system) while dist.timeout_s is 5: the other
    rank waits for it on the control plane (dist.control_timeout_s), and the run finishes. Before the split, that
    wait was a broadcast on the training group and failed after 5 s."""
    result = train(tmp_path, 2, "train.max_steps=8", "ckpt.every_steps=4", "dist.timeout_s=5",
                   "dist.control_timeout_s=120", "fault.hang_timeout_s=0",
                   fault="slow:rank=0:step=4:phase=checkpoint:seconds=12", timeout=200)
    assert "Timed out" not in result.output and "timed out" not in result.output
    assert sorted(p.name for p in (tmp_path / "checkpoints").glob("step_*")) == ["step_00000004", "step_00000008"]


def test_control_timeout_below_the_training_timeout_is_refused(tmp_path: Path):
    result = train(tmp_path, 1, "dist.timeout_s=60", "dist.control_timeout_s=30", expect=2)
    assert "dist.control_timeout_s" in result.stderr and "at least dist.timeout_s (60)" in result.stderr
