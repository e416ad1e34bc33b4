import http.client
import json
import os
import signal
import stat
import time
import urllib.error
from pathlib import Path

import pytest
import torch

from hpctrain.config.schema import AlertSection
from hpctrain.dist.runtime import single_process_runtime
from hpctrain.errors import UserError
from hpctrain.fault.alerts import Alerter, build_payload, choose_format, resolve_webhook, summary_text, webhook_host
from hpctrain.fault.heartbeat import Heartbeat, Limits, Watchdog, read_heartbeats, stuck_ranks
from hpctrain.fault.inject import build_injector, parse_faults
from hpctrain.fault.requeue import requeue_slurm_job
from hpctrain.fault.signals import StopSignals, stop_signal_names
from hpctrain.fault.vote import NOTHING, StepVote

SINGLE = single_process_runtime(torch.device("cpu"))


def test_signal_handler_only_records():
    # Every signal the launcher forwards is a stop, whatever fault.warning_signal is (SIGHUP: a dropped SSH session)
    for warning in ("none", "SIGUSR2", "SIGUSR1", "SIGHUP"):
        assert set(stop_signal_names(warning)) == {"SIGINT", "SIGTERM", "SIGHUP", "SIGUSR1", "SIGUSR2"}, warning
    signals = StopSignals().install(stop_signal_names("SIGUSR2"))
    try:
        os.kill(os.getpid(), signal.SIGUSR2)
        assert signals.received == signal.SIGUSR2
        os.kill(os.getpid(), signal.SIGHUP)
        assert signals.received == signal.SIGHUP
        os.kill(os.getpid(), signal.SIGTERM)
        assert signals.received == signal.SIGTERM
    finally:
        signals.uninstall()
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL


def test_vote_is_collected_one_boundary_later():
    vote = StepVote(SINGLE)
    assert vote.collect() == NOTHING
    vote.cast(15, False)
    verdict = vote.collect()
    assert verdict.stop_signal == 15 and not verdict.save_due
    assert vote.collect() == NOTHING  # nothing pending any more
    vote.cast(0, True)
    assert vote.collect().save_due


def test_fault_specs():
    (f,) = parse_faults("hang:rank=1:step=3:seconds=2")
    assert (f.action, f.rank, f.step, f.phase, f.seconds) == ("hang", 1, 3, "forward", 2.0)
    assert len(parse_faults("crash:rank=0:step=1;kill:rank=1:step=2:phase=backward")) == 2
    with pytest.raises(ValueError, match="unknown action"):
        parse_faults("explode:rank=0:step=1")
    assert build_injector("crash:rank=1:step=3", rank=0) is None
    inject = build_injector("crash:rank=0:step=3:phase=backward", rank=0)
    inject("forward", 3)
    inject("backward", 2)
    with pytest.raises(RuntimeError, match="injected crash"):
        inject("backward", 3)
    inject("backward", 3)  # fires once


def test_watchdog_reports_a_stall_with_the_stack(tmp_path: Path):
    seen = []
    hb = Heartbeat(rank=0, host="h")
    dog = Watchdog(hb, tmp_path, every_s=60, hang_timeout_s=0.05, is_main=True, on_hang=seen.append)
    hb.mark("forward", 7)
    dog.beat()
    assert not seen and json.loads((tmp_path / "rank_0.json").read_text())["phase"] == "forward"
    time.sleep(0.1)
    dog.beat()
    dog.beat()  # one report per stall
    assert len(seen) == 1 and seen[0][0]["rank"] == 0 and seen[0][0]["phase"] == "forward"
    text = (tmp_path / "stuck_rank_0.txt").read_text()
    assert "phase 'forward' at step 7" in text and "test_watchdog_reports_a_stall_with_the_stack" in text
    assert json.loads((tmp_path / "hang_report.json").read_text())["stuck"][0]["step"] == 7
    dog.stop()
    assert read_heartbeats(tmp_path)[0]["phase"] == "done"


def test_stuck_ranks_oldest_first_and_done_ranks_are_not_stuck():
    beats = [
        {"rank": 0, "since": 100.0, "phase": "backward", "step": 5, "host": "a", "pid": 1},
        {"rank": 1, "since": 90.0, "phase": "forward", "step": 5, "host": "b", "pid": 2},
        {"rank": 2, "since": 10.0, "phase": "done", "step": 9, "host": "c", "pid": 3},
    ]
    assert [b["rank"] for b in stuck_ranks(beats, now=200.0, limits=Limits(50, 0, 10))] == [1, 0]


def test_payload_shapes():
    fields = {"event": "failure", "run": "r", "job_id": "7", "host": "n1", "rank": 1, "last_step": 12,
              "exit_code": 137, "detail": "rank 1 killed by SIGKILL", "log_tail": ["a", "b"]}
    assert build_payload("json", fields) == fields
    slack = build_payload("slack", fields)
    assert list(slack) == ["text"] and "FAILURE" in slack["text"] and "exit code 137" in slack["text"]
    assert list(build_payload("discord", fields)) == ["content"]
    assert choose_format("auto", "https://hooks.slack.com/services/T/B/x") == "slack"
    assert choose_format("auto", "https://discord.com/api/webhooks/1/x") == "discord"
    assert choose_format("auto", "https://chat.example.org/hooks/abc/slack") == "slack"
    assert choose_format("auto", "https://example.org/hook") == "json"
    assert "job 7 on n1, rank 1" in summary_text(fields)


def test_dead_webhook_never_raises_and_never_logs_the_url(caplog):
    alerter = Alerter("http://127.0.0.1:9/secret-token", AlertSection(timeout_s=1), "r", "d", "", 0)
    assert alerter.send("failure", last_step=1) is False
    assert "secret-token" not in caplog.text and "127.0.0.1" in caplog.text
    bad = Alerter("notaurl-secret", AlertSection(), "r", "d", "", 0)
    assert bad.send("failure", last_step=1) is False and "notaurl-secret" not in caplog.text
    assert Alerter("", AlertSection(), "r", "d", "", 0).send("failure", last_step=1) is False
    assert not Alerter("http://x", AlertSection(), "r", "d", "", 0).enabled("complete")  # not in default events


# Webhook URLs a typo or a pasted file can produce; each must fail quietly, naming at most the host.
MALFORMED = ["http://127.0.0.1:9/hooks/secret-token\nfoo", "http://127.0.0.1:9/hooks/secret-token\r\n# note",
             "http://127.0.0.1:9/hooks/secret token", "http://127.0.0.1:9/hooks/secret-token\t",
             "http://127.0.0.1:9/\x7fsecret-token", "http://h\x00st/secret-token", "http://127.0.0.1:9/sécret-token",
             "http://[::1/secret-token", "http://127.0.0.1:99999/secret-token", "file:///secret-token",
             "http:///secret-token", "secret-token"]


@pytest.mark.parametrize("url", MALFORMED)
def test_a_malformed_webhook_never_raises_and_never_leaks(url, caplog):
    assert Alerter(url, AlertSection(timeout_s=1), "r", "d", "", 0).send("requeue", last_step=4) is False
    assert "alert 'requeue' to webhook at" in caplog.text and "failed" in caplog.text
    assert "secret" not in caplog.text and webhook_host(url) in ("127.0.0.1", "?")


def _raising(err: BaseException):
    def urlopen(*_a, **_k):
        raise err
    return urlopen


URL = "http://127.0.0.1:9/hooks/secret-token?key=secret-token"


@pytest.mark.parametrize("err, said", [
    (http.client.InvalidURL(f"URL can't contain control characters. '{URL}'"), "InvalidURL"),
    (http.client.IncompleteRead(URL.encode()), "IncompleteRead"),
    (UnicodeEncodeError("ascii", URL, 0, 1, "ordinal not in range"), "UnicodeEncodeError"),
    (urllib.error.URLError(f"unknown url type: {URL}"), "URLError"),
    (urllib.error.HTTPError(URL, 502, f"Bad Gateway {URL}", {}, None), "HTTP 502"),
    (ConnectionRefusedError(111, "Connection refused"), "ConnectionRefusedError: Connection refused"),
    (OSError(f"Tunnel connection failed: {URL}"), "OSError"),
    (RuntimeError(URL), "RuntimeError"),
])
def test_any_send_failure_is_reported_by_type_and_host_only(err, said, monkeypatch, caplog):
    monkeypatch.setattr("urllib.request.urlopen", _raising(err))
    assert Alerter(URL, AlertSection(), "r", "d", "", 0).send("hang", last_step=1) is False
    assert f"alert 'hang' to webhook at 127.0.0.1 failed: {said} (training" in caplog.text
    assert "secret" not in caplog.text and "hooks" not in caplog.text


def test_keyboard_interrupt_still_interrupts_a_send(monkeypatch):
    monkeypatch.setattr("urllib.request.urlopen", _raising(KeyboardInterrupt()))
    with pytest.raises(KeyboardInterrupt):
        Alerter(URL, AlertSection(), "r", "d", "", 0).send("hang", last_step=1)


@pytest.mark.parametrize("url", ["http://[::1/secret-token", "http://[secret-token]/", "", "::", "http://a b/x",
                                 "http://user:secret-token@[::1]:80/"])
def test_webhook_host_never_raises_and_shows_only_a_host(url):
    assert "secret" not in webhook_host(url) and " " not in webhook_host(url)


@pytest.mark.parametrize("text, problem", [
    ("http://127.0.0.1:9/hooks/secret-token\nsecond line\n", "line break"),
    ("http://127.0.0.1:9/hooks/secret token\n", "space or a control character"),
    ("127.0.0.1:9/hooks/secret-token", "does not start with https:// or http://"),
])
def test_a_malformed_webhook_is_refused_up_front_without_quoting_it(text, problem, tmp_path, monkeypatch):
    path = tmp_path / "hook"
    path.write_text(text)
    monkeypatch.delenv("HPCTRAIN_ALERT_WEBHOOK", raising=False)
    with pytest.raises(UserError) as err:
        resolve_webhook(AlertSection(webhook_file=str(path)))
    said = f"{err.value}\n{err.value.hint}"
    assert problem in said and f"alert.webhook_file '{path}'" in said and "URL alone" in said
    assert "secret" not in said and "hooks" not in said

    monkeypatch.setenv("HPCTRAIN_ALERT_WEBHOOK", f"  {text}  ")  # the environment takes precedence
    with pytest.raises(UserError) as err:
        resolve_webhook(AlertSection(webhook_file=str(path)))
    said = f"{err.value}\n{err.value.hint}"
    assert problem in said and "HPCTRAIN_ALERT_WEBHOOK" in said and "secret" not in said


def test_a_webhook_file_may_end_with_a_newline(tmp_path, monkeypatch):
    monkeypatch.delenv("HPCTRAIN_ALERT_WEBHOOK", raising=False)
    (tmp_path / "hook").write_text("https://hooks.example.org/secret-token\n")
    assert resolve_webhook(AlertSection(webhook_file=str(tmp_path / "hook"))) == "https://hooks.example.org/secret-token"


def fake_scontrol(tmp_path: Path, code: int) -> Path:
    record = tmp_path / "calls"
    script = tmp_path / "bin" / "scontrol"
    script.parent.mkdir()
    script.write_text(f"#!/bin/sh\necho \"$@\" >> {record}\necho 'requeue refused' >&2\nexit {code}\n")
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    return record


def test_requeue_calls_scontrol(tmp_path: Path, monkeypatch):
    record = fake_scontrol(tmp_path, 0)
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}:{os.environ['PATH']}")
    assert requeue_slurm_job("4242") is True
    assert record.read_text().split() == ["requeue", "4242"]


def test_requeue_failures_are_explained_not_raised(tmp_path: Path, monkeypatch, caplog):
    fake_scontrol(tmp_path, 1)
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}:{os.environ['PATH']}")
    assert requeue_slurm_job("1") is False and "requeue refused" in caplog.text and "--requeue" in caplog.text
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    assert requeue_slurm_job("1") is False and "not on PATH" in caplog.text


def test_after_a_stop_signals_are_ignored_not_handled_in_python():
    signals = StopSignals().install(["SIGTERM", "SIGUSR2"])
    try:
        signals.ignore_from_now()
        assert signal.getsignal(signal.SIGTERM) == signal.SIG_IGN  # survives interpreter shutdown, unlike a handler
        os.kill(os.getpid(), signal.SIGUSR2)  # would end the process if it were not ignored
    finally:
        signals.uninstall()
    assert signal.getsignal(signal.SIGUSR2) == signal.SIG_DFL


def test_ctrl_c_once_stops_with_a_checkpoint_twice_stops_at_once_and_never_masks_a_preemption(monkeypatch):
    import signal as sig

    import pytest

    from hpctrain.fault import signals as mod
    from hpctrain.fault.signals import StopSignals

    clock = [100.0]
    monkeypatch.setattr(mod.time, "monotonic", lambda: clock[0])
    s = StopSignals()
    s._handle(sig.SIGINT, None)
    assert s.received == sig.SIGINT
    clock[0] += 0.05
    s._handle(sig.SIGINT, None)  # the same press delivered twice (Slurm signals every process, the launcher forwards)
    clock[0] += 2.0
    with pytest.raises(KeyboardInterrupt):
        s._handle(sig.SIGINT, None)  # a second press
    t = StopSignals()
    t._handle(sig.SIGTERM, None)
    t._handle(sig.SIGINT, None)
    assert t.received == sig.SIGTERM  # the cluster's stop keeps its meaning: requeue, not "the user stopped it"


def test_the_vote_ranks_ctrl_c_below_every_cluster_stop():
    import signal as sig

    from hpctrain.fault.vote import _priority

    assert max(_priority(sig.SIGINT), _priority(sig.SIGHUP)) == _priority(sig.SIGHUP)
    assert max(_priority(sig.SIGINT), _priority(0)) == _priority(sig.SIGINT)


def test_one_process_vote_returns_ctrl_c_as_sigint():
    import signal as sig

    import torch

    from hpctrain.dist.runtime import single_process_runtime
    from hpctrain.fault.vote import StepVote

    vote = StepVote(single_process_runtime(torch.device("cpu")))
    vote.cast(sig.SIGINT, False)
    assert vote.collect().stop_signal == sig.SIGINT


def test_the_launcher_counts_one_press_once(monkeypatch):
    from hpctrain.launcher import signals as launch

    forwarded, clock = [], [50.0]
    monkeypatch.setattr(launch, "_forward", lambda signum, frame: forwarded.append(signum))
    monkeypatch.setattr(launch, "_kill_children_in", lambda seconds: forwarded.append(("kill in", seconds)))
    monkeypatch.setattr("time.monotonic", lambda: clock[0])
    monkeypatch.setattr(launch._Interrupts, "count", 0)
    monkeypatch.setattr(launch._Interrupts, "first_at", 0.0)
    launch._Interrupts.handle(2, None)
    clock[0] += 0.1
    launch._Interrupts.handle(2, None)  # the same press
    assert forwarded == [2] and launch._Interrupts.count == 1
    clock[0] += 3
    launch._Interrupts.handle(2, None)
    launch._Interrupts.handle(2, None)  # a third press does not push the kill further away
    assert forwarded == [2, 2, ("kill in", launch.INTERRUPT_GRACE_S), 2]


def test_a_stop_at_an_outputs_step_puts_them_off_to_the_resumed_run(tmp_path, monkeypatch):
    """A stop signal at a step with outputs due (the DDPM sample grid) saves first and skips them; the flag travels
    in the checkpoint's train state, and the resumed loop makes them at that step before its first step."""
    from hpctrain.fault.vote import Verdict
    from hpctrain.train import loop
    from hpctrain.train.state import TrainState
    from tests.unit.test_step_modes import _context  # the tiny DDPM's context, which has outputs

    ctx = _context(tmp_path, monkeypatch, "log.outputs_every_steps=3", "eval.every_steps=0", "train.max_steps=6")
    made: list[int] = []
    monkeypatch.setattr(ctx.experiment, "outputs", lambda model, out: made.append(out.step))
    saved: list[dict] = []
    ctx.checkpointer = type("Saves", (), {"save": lambda self, state, *a, **k: saved.append(dict(state))})()
    collect = ctx.fault.vote.collect
    monkeypatch.setattr(ctx.fault.vote, "collect",
                        lambda: Verdict(15, False) if ctx.state.step == 3 else collect())
    result = loop.train(ctx)
    assert result.stop_signal == 15 and ctx.state.step == 3 and made == []
    assert saved[-1]["outputs_pending"] and not saved[-1]["eval_pending"]
    ctx.state = TrainState.from_dict(saved[-1])  # as a resume reads it
    monkeypatch.setattr(ctx.fault.vote, "collect", collect)
    loop.train(ctx)
    assert made == [3, 6] and ctx.state.step == 6
