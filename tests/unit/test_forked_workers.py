"""Workers forked from the launcher (launcher/forked_workers, launcher/fork_safety): the process torchrun gets looks
like the one its Popen would give. The launches of tests/dist run through it on this CPU machine; a few of them run with
HPCTRAIN_WORKER_START=exec too (tests/dist/test_launcher.py), so torchrun's own Popen stays tested."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
import tempfile
import time
import weakref
from pathlib import Path

import pytest

from hpctrain.launcher import fork_safety as fs
from hpctrain.launcher import forked_workers as fw


def test_the_fork_path_is_refused_where_it_is_unsafe_or_turned_off(monkeypatch):
    assert fs.fork_refusal({fs.WORKER_START_ENV: "exec"}) == "HPCTRAIN_WORKER_START=exec"
    assert "is not auto or exec" in fs.fork_refusal({fs.WORKER_START_ENV: "sometimes"})
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert "CUDA" in fs.fork_refusal({})
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert fs.fork_refusal({}) is None and fs.fork_refusal({fs.WORKER_START_ENV: "auto"}) is None


def test_only_this_python_running_hpctrain_is_forked():
    assert fw.module_command(sys.executable, ("-u", "-m", "hpctrain", "train", "digits")) == ("hpctrain",
                                                                                            ["train", "digits"])
    assert fw.module_command(sys.executable, ("-u", "-m", "other", "x")) is None
    assert fw.module_command("/usr/bin/numactl", ("-u", "-m", "hpctrain")) is None
    assert fw.module_command(sys.executable, ("-m", "hpctrain")) is None  # not torchrun's command shape
    assert fw.module_command(sys.executable, ("-u", "-m")) is None


def test_the_factory_is_replaced_only_within_the_launch():
    from torch.distributed.elastic.multiprocessing import api

    original = api.get_subprocess_handler
    with fw.forked_workers(True, ("json",)) as active:
        assert active and api.get_subprocess_handler is not original
    assert api.get_subprocess_handler is original
    with fw.forked_workers(False) as active:
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


def test_a_forked_worker_keeps_none_of_the_launchers_file_descriptors(tmp_path):
    """As exec would: a worker that outlives a SIGKILLed launcher must not hold its store's listening port."""
    import socket

    listening = socket.create_server(("127.0.0.1", 0))
    state, out = tmp_path / "state.json", tmp_path / "out.txt"

    def entry_point():
        links = {}
        for fd in os.listdir("/proc/self/fd"):  # listdir's own fd is among them, closed by the time it is read
            with contextlib.suppress(OSError):
                links[int(fd)] = os.readlink(f"/proc/self/fd/{fd}")
        Path(state).write_text(json.dumps(links))
        os._exit(0)

    try:
        with open(out, "w") as stdout:
            proc = fw.ForkedProcess.start(["train"], {}, stdout, None, entry_point)
            assert proc.wait(timeout=60) == 0
    finally:
        listening.close()
    links = {int(fd): link for fd, link in json.loads(state.read_text()).items()}
    assert {0, 1, 2} <= set(links) and not [fd for fd, link in links.items() if fd > 2 and "socket" in link], links
    assert len([fd for fd in links if fd > 2]) <= 1, links  # nothing of the launcher's (pytest's pipes and files)


def test_a_torch_whose_factory_takes_another_keyword_gets_torchruns_own_workers(monkeypatch, capsys):
    from torch.distributed.elastic.multiprocessing import api

    original = api.get_subprocess_handler

    def newer(entrypoint, args, env, stdout, stderr, local_rank_id, numa_options=None, cpu_affinity=None):
        return original(entrypoint=entrypoint, args=args, env=env, stdout=stdout, stderr=stderr,
                        local_rank_id=local_rank_id, numa_options=numa_options)

    monkeypatch.setattr(api, "get_subprocess_handler", newer)
    with fw.forked_workers(True) as active:
        assert not active and api.get_subprocess_handler is newer
    assert "its workers start as new Pythons" in capsys.readouterr().err


THREADS_SCRIPT = """
import os, torch
from hpctrain.launcher import fork_safety as fw
os.environ.pop("OMP_NUM_THREADS", None)
before = fw.quiet_launcher()
assert torch.get_num_threads() == 1 and before.intra_op == 2, (torch.get_num_threads(), before)
(torch.randn(4_000_000) * 2).sum()  # the user's module-level op: one thread, no OpenMP team
assert fw.thread_refusal(before) is None, fw.thread_refusal(before)
torch.set_num_threads(2)  # user code raises the count: unsafe whatever ran
assert "intra-op threads to 2" in fw.thread_refusal(before)
(torch.randn(4_000_000) * 2).sum()  # OpenMP's team starts
torch.set_num_threads(1)
assert "native thread(s) started" in fw.thread_refusal(before), fw.thread_refusal(before)
print("ok")
"""


def test_the_launcher_starts_no_openmp_team_and_sees_one_that_user_code_started():
    """In a fresh Python (pytest's own process may have run parallel ops): quiet_launcher keeps the team from
    starting; thread_refusal sees a raised thread count and threads started since."""
    import subprocess

    env = {**os.environ, "OMP_NUM_THREADS": "2"}
    result = subprocess.run([sys.executable, "-c", THREADS_SCRIPT], env=env, capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr


PLAIN_SCRIPT = """
import threading, torch
from hpctrain.launcher import fork_safety as fw
before = fw.quiet_launcher()
assert before.unexplained == 0 and not before.python, (before, fw.openblas_server_threads())
assert fw.thread_refusal(before) is None, fw.thread_refusal(before)
threading.Thread(target=threading.Event().wait, args=(60,), name="prefetcher", daemon=True).start()  # at the import
assert "Python thread(s) 'prefetcher' started at the import" in fw.thread_refusal(before), fw.thread_refusal(before)
print("ok")
"""

PLUGIN_SCRIPT = """
import threading, torch
(torch.randn(4_000_000) * 2).sum()  # a plugin's tensor op before hpctrain runs: OpenMP's team starts
threading.Thread(target=threading.Event().wait, args=(60,), name="plugin", daemon=True).start()
from hpctrain.launcher import fork_safety as fw
before = fw.quiet_launcher()
assert before.unexplained >= 1, (before, fw.openblas_server_threads())  # the team's threads besides the caller
assert "more than numpy's OpenBLAS keeps" in fw.thread_refusal(before), fw.thread_refusal(before)
import dataclasses
before = dataclasses.replace(before, unexplained=0)
assert "Python thread(s) 'plugin' were running before" in fw.thread_refusal(before), fw.thread_refusal(before)
plugin = next(t for t in threading.enumerate() if t.name == "plugin")
assert fw.thread_refusal(before, frozenset({plugin})) is None  # one hpctrain's own imports started
print("ok")
"""


@pytest.mark.parametrize("omp", ["unset", "1", "2"])
def test_a_plain_launcher_forks_and_one_with_a_python_thread_from_user_code_does_not(omp):
    """What a plain `import torch` leaves (numpy's OpenBLAS server: one thread fewer than its count) is no reason
    to refuse; a Python thread that user code started at its import is: a lock it holds at the fork stays held."""
    import subprocess

    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    env.update({} if omp == "unset" else {"OMP_NUM_THREADS": omp})
    result = subprocess.run([sys.executable, "-c", PLAIN_SCRIPT], env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr


def test_an_openmp_team_or_a_python_thread_from_before_quiet_launcher_refuses_the_fork():
    """A sitecustomize or .pth plugin that ran a tensor op (OMP_NUM_THREADS=2) left an OpenMP team before
    quiet_launcher could keep it from starting: its threads were taken as known ones, and the workers hung."""
    import subprocess

    env = {**os.environ, "OMP_NUM_THREADS": "2"}
    result = subprocess.run([sys.executable, "-c", PLUGIN_SCRIPT], env=env, capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr


def test_a_forked_worker_without_omp_num_threads_gets_the_launchers_count_from_before_quiet_launcher(tmp_path):
    state = tmp_path / "threads.json"

    def entry_point():
        import torch

        Path(state).write_text(json.dumps(torch.get_num_threads()))
        os._exit(0)

    import torch

    previous = torch.get_num_threads()
    torch.set_num_threads(1)  # as quiet_launcher leaves the launcher
    try:
        proc = fw.ForkedProcess.start(["train"], {}, None, None, entry_point, intra_op=3)
        assert proc.wait(timeout=60) == 0
        assert json.loads(state.read_text()) == 3
        proc = fw.ForkedProcess.start(["train"], {"OMP_NUM_THREADS": "2"}, None, None, entry_point, intra_op=3)
        assert proc.wait(timeout=60) == 0
        assert json.loads(state.read_text()) == 2
    finally:
        torch.set_num_threads(previous)


WORKER_MODULE = """
import json, os, sys
if __name__ == "__main__":
    with open(os.environ["STATE"], "w") as state:
        json.dump({"argv": sys.argv, "file": __file__}, state)
    if sys.argv[1:] == ["fail"]:
        raise SystemExit(4)
"""


def test_a_forked_worker_runs_its_commands_module_as_main(tmp_path, monkeypatch):
    """torchrun's ``python -u -m MODULE ARGS``: the fork runs MODULE as ``__main__`` with ARGS in sys.argv, as the new
    Python would (no entry point of hpctrain's imported for it); its own exit status, or 0 when it returns."""
    (tmp_path / "worker_module.py").write_text(WORKER_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    state = tmp_path / "state.json"
    for args, code in ((["a", "b=1"], 0), (["fail"], 4)):
        proc = fw.ForkedProcess.start(args, {"STATE": str(state)}, None, None, fw.ModuleEntry("worker_module"))
        assert proc.wait(timeout=60) == code
        got = json.loads(state.read_text())
        assert got["argv"] == [str(tmp_path / "worker_module.py"), *args] and got["file"] == got["argv"][0]
