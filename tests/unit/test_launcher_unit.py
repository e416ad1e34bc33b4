import sys

import pytest

from hpctrain.launcher.arguments import torchrun_args
from hpctrain.launcher.failures import exit_code
from hpctrain.commands.train import TrainRequest


def test_worker_exit_codes_pass_through():
    assert exit_code(2) == 2  # bad input in a worker stays "bad input"
    assert exit_code(-9) == 137 and exit_code(-15) == 143  # killed by a signal, as a shell reports it
    assert exit_code(0) == 1  # a failure record with code 0 is still a failure


def test_torchrun_reruns_the_same_request_without_nproc():
    req = TrainRequest("digits", "cfg.toml", ("train.max_steps=3",), 4, True)
    args = torchrun_args(4, req.module_args())
    assert args[:2] == ["--standalone", "--nproc-per-node=4"] and args[2:4] == ["-m", "hpctrain"]
    tail = args[4:]
    assert tail[:2] == ["train", "digits"] and tail[2] == "--config" and tail[3].endswith("/cfg.toml")
    assert tail[4:] == ["train.max_steps=3", "--debug"]
    assert not any("nproc" in a for a in tail)


def test_first_failure_prefers_the_cause_over_torchruns_shutdown_sigterm():
    from types import SimpleNamespace

    from hpctrain.launcher.failures import first_failure

    lost_peer = {"message": "RuntimeError: [gloo/pair.cc:561] Connection closed by peer [127.0.0.1]:123. "
                            "This is typically caused by a remote worker crashing."}
    err = SimpleNamespace(failures={
        0: SimpleNamespace(timestamp=99, exitcode=1, message=lost_peer),  # its error came first, but says why
        1: SimpleNamespace(timestamp=100, exitcode=-9, message=""),  # the rank that died, stamped when noticed
        2: SimpleNamespace(timestamp=100, exitcode=-15, message=""),  # torchrun's shutdown
    })
    assert first_failure(err)[0] == 1
    del err.failures[1]
    assert first_failure(err)[0] == 0  # only consequences left: the earliest
    crash = SimpleNamespace(failures={0: SimpleNamespace(timestamp=100, exitcode=1, message="ValueError: bad batch"),
                                      1: SimpleNamespace(timestamp=100, exitcode=1, message=lost_peer)})
    assert first_failure(crash)[0] == 0


def test_after_ctrl_c_a_rank_that_lost_its_peer_is_part_of_the_interrupt_not_a_failure(monkeypatch, capsys):
    """The second Ctrl-C: rank 0 leaves with 130 while rank 1, waiting in a collective, fails on the closed
    connection before its own KeyboardInterrupt is raised (seen in the suite). A real error stays a failure."""
    from types import SimpleNamespace

    from hpctrain.launcher import failures, signals

    lost_peer = {"message": "RuntimeError: [gloo/pair.cc:561] Connection closed by peer [127.0.0.1]:123."}
    err = SimpleNamespace(failures={0: SimpleNamespace(timestamp=1, exitcode=130, message="", local_rank=0, pid=7),
                                    1: SimpleNamespace(timestamp=1, exitcode=1, message=lost_peer, local_rank=1, pid=8)})
    monkeypatch.setattr(signals._Interrupts, "count", 2)
    assert failures.report(err) == signals.INTERRUPTED
    assert "hpctrain: interrupted (Ctrl-C): all 2 workers stopped;" in capsys.readouterr().err
    err.failures[1].message = "ValueError: bad batch"
    assert failures.report(err) == 130 and "failed first" in capsys.readouterr().err  # rank 0 first: 130
    monkeypatch.setattr(signals._Interrupts, "count", 0)  # no Ctrl-C: the same exits are a failure
    err.failures[1].message = lost_peer
    assert failures.report(err) == 130 and "failed first" in capsys.readouterr().err


def test_failure_message_keeps_a_user_errors_message_before_its_hint():
    from types import SimpleNamespace

    from hpctrain.launcher.failures import failure_message

    user = SimpleNamespace(message={"message": "DataError: sample '7' of shard s.tar: cannot decode .png\nHINT: re-create it."})
    assert failure_message(user) == "DataError: sample '7' of shard s.tar: cannot decode .png (HINT: re-create it.)"
    crash = SimpleNamespace(message="Traceback (most recent call last):\n  ...\nRuntimeError: boom")
    assert failure_message(crash) == "RuntimeError: boom"
    assert failure_message(SimpleNamespace(message="To enable traceback see: ...")) == ""
    ddp = SimpleNamespace(message={"message": (
        "RuntimeError: Expected to have finished reduction in the prior iteration before starting a new one.\n"
        "Parameter indices which did not receive grad for rank 0: 3 4\n"
        " In addition, you can set the environment variable TORCH_DISTRIBUTED_DEBUG to either INFO or DETAIL")})
    assert failure_message(ddp).startswith("RuntimeError: Expected to have finished reduction")  # the error, not advice


def test_ddps_unused_parameter_error_says_what_to_set():
    from hpctrain.errors import UserError
    from hpctrain.train.guard import translate_error

    err = translate_error(RuntimeError(
        "Expected to have finished reduction in the prior iteration before starting a new one. This error indicates "
        "that your module has parameters that were not used in producing loss. ...\nParameter indices which did not "
        "receive grad for rank 1: 3 4\n In addition, you can set the environment variable TORCH_DISTRIBUTED_DEBUG"))
    assert isinstance(err, UserError) and "set dist.find_unused_parameters=true" in err.hint
    assert str(err).startswith("DDP: some trainable parameters got no gradient in this step (rank 1: parameter "
                               "indices 3 4)")
    other = ValueError("x")
    assert translate_error(other) is other


def test_the_done_line_says_which_step_an_earlier_validation_was_at():
    from hpctrain.train.ending import done_val

    assert done_val({"loss": 0.5, "accuracy": 0.9, "iou/x": 1.0}, 14, 14) == "; val loss 0.5000, accuracy 0.9000"
    assert done_val({"loss": 0.5}, 14, 25) == "; val at step 14: loss 0.5000"  # train.stop_at_step=25
    assert done_val({}, 0, 25) == ""


def test_the_agent_environment_is_the_workers_and_is_restored(monkeypatch):
    import os

    from hpctrain.dist.env import AGENT_VARIABLES, agent_environment, agent_pid, under_hpctrain_agent

    for name in AGENT_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    with agent_environment("/tmp/x/error.json"):
        assert agent_pid() == os.getpid() and under_hpctrain_agent()
        assert os.environ["TORCHELASTIC_ERROR_FILE"] == "/tmp/x/error.json"
        os.environ["OMP_NUM_THREADS"] = "1"  # what torchrun does for several workers
        os.environ["TORCHELASTIC_SIGNALS_TO_HANDLE"] = "SIGQUIT"
    assert not under_hpctrain_agent() and os.environ["OMP_NUM_THREADS"] == "3"
    assert "TORCHELASTIC_ERROR_FILE" not in os.environ and "TORCHELASTIC_SIGNALS_TO_HANDLE" not in os.environ
    assert agent_pid({"HPCTRAIN_AGENT": "1234"}) == 1234 and agent_pid({"HPCTRAIN_AGENT": "x"}) == 0


ORPHAN = """
import os, signal, subprocess, sys, time
if sys.argv[1] == "launcher":
    child = subprocess.Popen([sys.executable, __file__, "worker", sys.argv[2]], start_new_session=True)
    time.sleep(60)  # killed by the test
else:
    got = []
    signal.signal(signal.SIGTERM, lambda *a: got.append(1))
    from hpctrain.dist.parent_death import stop_with_launcher
    stop_with_launcher(os.getppid())
    open(sys.argv[2] + ".armed", "w").close()
    deadline = time.monotonic() + 30
    while not got and time.monotonic() < deadline:
        time.sleep(0.05)
    open(sys.argv[2], "w").write("SIGTERM" if got else "nothing")
"""


def test_a_worker_gets_sigterm_when_its_launcher_is_killed(tmp_path):
    """torchrun's workers run in sessions of their own: a SIGKILLed launcher's death reaches them only this way."""
    import os
    import signal
    import subprocess
    import time

    script, result = tmp_path / "orphan.py", tmp_path / "result"
    script.write_text(ORPHAN)
    launcher = subprocess.Popen([sys.executable, str(script), "launcher", str(result)])
    try:
        deadline = time.monotonic() + 60
        while not (tmp_path / "result.armed").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert (tmp_path / "result.armed").exists(), "the worker did not start"
        os.kill(launcher.pid, signal.SIGKILL)
        launcher.wait(timeout=10)
        deadline = time.monotonic() + 40
        while not result.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert result.read_text() == "SIGTERM"
    finally:
        if launcher.poll() is None:
            launcher.kill()


def test_a_forwarded_stop_signal_reaches_the_workers_not_the_node_monitors(tmp_path, monkeypatch):
    """top exits on SIGUSR2: monitoring would stop exactly when the final checkpoint is written."""
    import shutil
    import signal
    import subprocess
    import time

    from hpctrain.launcher import signals
    from hpctrain.monitor.sidecars import node_monitors, running_monitors

    if shutil.which("top") is None:
        pytest.skip("top is not installed here: no node monitor to keep running")
    monkeypatch.setenv("HPCTRAIN_MONITOR_DIR", str(tmp_path))
    monkeypatch.setenv("HPCTRAIN_MONITOR_EVERY", "1")
    worker = subprocess.Popen(["sleep", "60"])  # a stand-in for a worker: SIGUSR2's default action ends it
    bystander = subprocess.Popen(["sleep", "60"])  # pytest's other child: not the launcher's to signal
    try:
        with node_monitors() as paths:
            monitors = sorted(running_monitors())
            assert paths and monitors, f"top is installed but node_monitors started no monitor: {paths}"
            # The launcher's children are the worker and the monitors: pytest's own (an xdist worker's, a
            # fixture's server) must not get the signal, so the children the launcher sees are these only.
            monkeypatch.setattr(signals, "child_pids", lambda pid=None: [worker.pid, *monitors])
            signals._forward(signal.SIGUSR2, None)
            assert worker.wait(timeout=10) == -signal.SIGUSR2
            time.sleep(0.5)
            assert monitors and all(signals._process_state(p) not in ("", "Z") for p in monitors)  # still running
            assert bystander.poll() is None
    finally:
        for proc in (worker, bystander):
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def test_after_a_second_ctrl_c_the_launchers_own_kill_is_the_interrupt_not_a_failure(monkeypatch, capsys):
    """Workers stuck in C code never run their handlers: the launcher SIGKILLs them INTERRUPT_GRACE_S after the
    second press, and that is the user's interrupt (130, one line), not 'killed by SIGKILL' (137)."""
    import signal
    from types import SimpleNamespace

    from hpctrain.launcher import failures, signals

    err = SimpleNamespace(failures={r: SimpleNamespace(timestamp=1, exitcode=-signal.SIGKILL, message="", local_rank=r,
                                                       pid=7 + r) for r in (0, 1)})
    monkeypatch.setattr(signals._Interrupts, "count", 2)
    monkeypatch.setattr(signals._Interrupts, "killed", frozenset({7, 8}))
    assert failures.report(err) == signals.INTERRUPTED
    assert "all 2 workers stopped; 2 still running 10 s after the second press were killed;" in capsys.readouterr().err
    monkeypatch.setattr(signals._Interrupts, "killed", frozenset())  # killed by someone else: a failure
    assert failures.report(err) == 137 and "failed first" in capsys.readouterr().err


KILLS = """
import os, signal, subprocess, sys, time
from types import SimpleNamespace
from hpctrain.launcher import failures, signals
from hpctrain.fault.signals import SAME_PRESS_S

signal.signal(signal.SIGTERM, signals._forward)  # as launcher.torchrun.main installs them
signal.signal(signal.SIGINT, signals._Interrupts.handle)


def stuck():
    # a worker stuck in C code: the stop signal and Ctrl-C do nothing to it (set before its exec: no race)
    return subprocess.Popen(["sleep", "60"], preexec_fn=lambda: [signal.signal(s, signal.SIG_IGN)
                                                                 for s in (signal.SIGTERM, signal.SIGINT)])


def scenario(name, sent, term_grace, interrupt_grace, oom_killed=False):
    signals.TERM_GRACE_S, signals.INTERRUPT_GRACE_S = term_grace, interrupt_grace
    signals._Interrupts.count, signals._Interrupts.first_at = 0, 0.0
    signals._Interrupts.killed = signals._StopGrace.killed = frozenset()
    workers = [stuck(), stuck()]
    for sig in sent:
        os.kill(os.getpid(), sig)
        time.sleep(SAME_PRESS_S + 0.3)  # another press, not the same one
    if oom_killed:
        os.kill(workers[0].pid, signal.SIGKILL)  # not the launcher's kill (the OOM killer's, say)
    for worker in workers:
        worker.wait(timeout=60)
    signal.alarm(0)
    err = SimpleNamespace(failures={r: SimpleNamespace(timestamp=1, exitcode=w.returncode, message="", local_rank=r,
                                                       pid=w.pid) for r, w in enumerate(workers)})
    print(f"== {name}", file=sys.stderr, flush=True)
    print(f"exit {failures.report(err)}", file=sys.stderr, flush=True)


scenario("preempted", [signal.SIGTERM, signal.SIGINT], term_grace=4, interrupt_grace=1)
scenario("interrupted", [signal.SIGINT, signal.SIGINT], term_grace=30, interrupt_grace=2)
scenario("preempted, then interrupted", [signal.SIGTERM, signal.SIGINT, signal.SIGINT], term_grace=30,
         interrupt_grace=2)
scenario("one killed by another", [signal.SIGINT, signal.SIGINT], term_grace=30, interrupt_grace=5, oom_killed=True)
"""


def test_workers_killed_by_the_stop_signals_grace_are_a_failure_not_a_ctrl_c(tmp_path):
    """A preemption (SIGTERM) whose workers hang, plus one Ctrl-C meanwhile: the launcher's SIGKILL after
    TERM_GRACE_S is said as such and fails the run (137), not 'interrupted (Ctrl-C) ... with a checkpoint ... after
    the second press' with 130. The interrupt's own kill keeps its line; a worker killed by someone else is not
    counted as the launcher's. In a child Python: real signals, an alarm and child processes of its own."""
    import subprocess

    script = tmp_path / "kills.py"
    script.write_text(KILLS)
    result = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, result.stderr
    said = dict(part.split("\n", 1) for part in result.stderr.split("== ")[1:])
    assert said.keys() == {"preempted", "interrupted", "preempted, then interrupted", "one killed by another"}, said
    preempted = said["preempted"]
    assert "worker ranks 0, 1 did not stop within 4 s after the stop signal (SIGTERM) and were killed" in preempted
    assert "interrupted" not in preempted and "exit 137" in preempted, preempted
    interrupted = said["interrupted"]
    assert "all 2 workers stopped; 2 still running 2 s after the second press were killed" in interrupted
    assert "exit 130" in interrupted, interrupted
    both = said["preempted, then interrupted"]  # the second press's kill came first: the user's interrupt
    assert "2 still running 2 s after the second press were killed" in both and "exit 130" in both, both
    oom = said["one killed by another"]
    assert "all 2 workers stopped; 1 still running 5 s after the second press were killed" in oom, oom


def test_oversubscribed_threads_are_said_with_what_to_set():
    from hpctrain.launcher.arguments import oversubscription

    line = oversubscription(2, {"OMP_NUM_THREADS": "2"}, cores=2)
    assert line and "2 processes x OMP_NUM_THREADS=2 = 4" in line and "set OMP_NUM_THREADS=1" in line
    assert oversubscription(2, {"OMP_NUM_THREADS": "1"}, cores=2) is None
    assert oversubscription(2, {}, cores=2) is None  # torchrun sets 1 per worker where it is unset
    assert oversubscription(4, {"OMP_NUM_THREADS": "8"}, cores=32) is None
    assert "fewer processes per node" in oversubscription(4, {}, cores=2)


def test_torchruns_error_line_is_dropped_for_clean_stop_codes_only():
    import logging

    from hpctrain.launcher.failures import CleanStopLines

    def line(code):
        return logging.LogRecord("torch", logging.ERROR, "api.py", 1, "failed (exitcode: %s) local_rank: %s (pid: %s)"
                                 " of binary: %s", (code, 0, 7, "python"), None)

    quiet = CleanStopLines(frozenset({75, 130}))
    assert not quiet.filter(line(75)) and not quiet.filter(line(130))
    assert quiet.filter(line(1)) and quiet.filter(line(-9)) and quiet.filter(line(2))
    assert quiet.filter(logging.LogRecord("torch", logging.WARNING, "x", 1, "other %s", (75,), None))
