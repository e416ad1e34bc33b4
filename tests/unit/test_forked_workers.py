"""Workers forked from the launcher (dist/forked_workers): the process torchrun gets looks like the one its Popen
would give. The launches of tests/dist run through it on this CPU machine; a few of them run with
HPCTRAIN_WORKER_START=exec too (tests/dist/test_launcher.py), so torchrun's own Popen stays tested."""

from __future__ import annotations

import json
import os
import signal
import sys
import tempfile
import time
import weakref
from pathlib import Path

import pytest

from hpctrain.dist import forked_workers as fw


def test_the_fork_path_is_refused_where_it_is_unsafe_or_turned_off(monkeypatch):
    assert fw.fork_refusal({fw.WORKER_START_ENV: "exec"}) == "HPCTRAIN_WORKER_START=exec"
    assert "is not auto or exec" in fw.fork_refusal({fw.WORKER_START_ENV: "sometimes"})
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert "CUDA" in fw.fork_refusal({})
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert fw.fork_refusal({}) is None and fw.fork_refusal({fw.WORKER_START_ENV: "auto"}) is None


def test_only_this_python_running_hpctrain_is_forked():
    assert fw.hpctrain_module_args(sys.executable, ("-u", "-m", "hpctrain", "train", "digits")) == ["train", "digits"]
    assert fw.hpctrain_module_args(sys.executable, ("-u", "-m", "other", "x")) is None
    assert fw.hpctrain_module_args("/usr/bin/numactl", ("-u", "-m", "hpctrain")) is None
    assert fw.hpctrain_module_args(sys.executable, ("-m", "hpctrain")) is None  # not torchrun's command shape


def test_the_factory_is_replaced_only_within_the_launch():
    from torch.distributed.elastic.multiprocessing import api

    original = api.get_subprocess_handler
    with fw.forked_workers(True, lambda: None, ("json",)) as active:
        assert active and api.get_subprocess_handler is not original
    assert api.get_subprocess_handler is original
    with fw.forked_workers(False, lambda: None) as active:
        assert not active and api.get_subprocess_handler is original


# What the launcher handles (hpctrain's forwarding, torchrun's --signals-to-handle) and the workers must not.
LAUNCHER_HANDLES = (signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2, signal.SIGHUP, signal.SIGQUIT, signal.SIGXCPU)


def _record_state(path: str, code: int):
    """The worker's main() stand-in: writes what it finds, then exits with ``code`` (or waits for a signal)."""

    def entry_point():
        Path(path).write_text(json.dumps({
            "pid": os.getpid(), "ppid": os.getppid(), "sid": os.getsid(0), "pgid": os.getpgid(0),
            "env": dict(os.environ), "argv": sys.argv[1:],
            "defaults": [signal.getsignal(s) == signal.SIG_DFL for s in LAUNCHER_HANDLES],
            "sigint_python": signal.getsignal(signal.SIGINT) is signal.default_int_handler,
            "blocked": sorted(int(s) for s in signal.pthread_sigmask(signal.SIG_BLOCK, [])),
        }))
        os.write(1, b"worker says hi\n")  # fd 1: pytest captures sys.stdout itself
        if code < 0:
            signal.pause()
        from hpctrain.process_exit import run_and_exit

        run_and_exit(lambda: code)

    return entry_point


def test_a_forked_worker_starts_as_a_new_python_would_and_its_exit_status_comes_back(tmp_path):
    state, out = tmp_path / "state.json", tmp_path / "out.txt"
    # The launcher's state a worker must not inherit: its signal handlers and mask, an exit-time finalizer.
    previous = {s: signal.signal(s, lambda *_: None) for s in (*LAUNCHER_HANDLES, signal.SIGINT)}
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGUSR1])
    launcher_dir = tempfile.mkdtemp(dir=tmp_path)
    finalizer = weakref.finalize(fw, os.rmdir, launcher_dir)  # fw (a module) lives on: only atexit would run it
    try:
        with open(out, "w") as stdout:
            proc = fw.ForkedProcess.start(["train", "digits", "x=1"], {"ONLY": "this", "OMP_NUM_THREADS": "1"},
                                          stdout, None, _record_state(str(state), 3))
            assert proc.wait(timeout=60) == 3 and proc.poll() == 3 and proc.returncode == 3
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)
        for s, handler in previous.items():
            signal.signal(s, handler)
        finalizer.detach()
    assert signal.pthread_sigmask(signal.SIG_BLOCK, []) == mask  # the launcher's own mask is back
    got = json.loads(state.read_text())
    assert got["ppid"] == os.getpid() and got["sid"] == got["pid"] == got["pgid"]  # its own session, our child
    assert got["env"] == {"ONLY": "this", "OMP_NUM_THREADS": "1"} and got["argv"] == ["train", "digits", "x=1"]
    assert all(got["defaults"]) and got["sigint_python"] and got["blocked"] == []
    assert out.read_text() == "worker says hi\n"
    assert os.path.isdir(launcher_dir)  # the launcher's finalizer did not run in the worker


def test_a_forked_worker_killed_by_a_signal_reports_it_as_popen_does(tmp_path):
    state = tmp_path / "state.json"
    proc = fw.ForkedProcess.start(["train"], {}, None, None, _record_state(str(state), -1))
    try:
        for _ in range(600):
            if state.exists():
                break
            time.sleep(0.05)
        with pytest.raises(Exception) as timed_out:
            proc.wait(timeout=0.2)
        assert type(timed_out.value).__name__ == "TimeoutExpired"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == -signal.SIGTERM
        proc.kill()  # a finished process: nothing happens
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait(timeout=60)


def test_a_signal_to_the_workers_group_the_moment_it_exists_meets_the_workers_own_handling(tmp_path):
    """torchrun may killpg a worker right after starting it (a rank failed at once), and the launcher forwards signals
    to every child it finds in /proc: the child's group must exist when start() returns, and the launcher's
    handler (here one that ignores SIGTERM) must not be what the child runs."""
    previous, proc = signal.signal(signal.SIGTERM, lambda *_: None), None
    try:
        proc = fw.ForkedProcess.start(["train"], {}, None, None, _record_state(str(tmp_path / "s.json"), -1))
        os.killpg(proc.pid, signal.SIGTERM)  # ProcessLookupError if its setsid had not happened yet
        assert proc.wait(timeout=60) == -signal.SIGTERM
    finally:
        signal.signal(signal.SIGTERM, previous)
        if proc is not None and proc.poll() is None:  # a failed test leaves no paused child holding pytest's output
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait(timeout=60)
