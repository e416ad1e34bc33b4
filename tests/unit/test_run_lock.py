"""One writer per run dir (fault/run_lock.py): a live holder is named and refused, a dead one's lock taken over (a
gone pid, a reused pid, a stale heartbeat from another host, our own job requeued), and only the holder removes it."""

from __future__ import annotations

import dataclasses
import json
import logging
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hpctrain.errors import UserError
from hpctrain.fault import run_lock


@pytest.fixture
def live_pid():
    """A process of ours that runs for the test, as another training's rank 0 would."""
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    yield proc.pid
    proc.kill()
    proc.wait()


def dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def place(run_dir: Path, owner: run_lock.Owner) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / run_lock.LOCK_FILE).write_text(json.dumps(dataclasses.asdict(owner)))


def holder_on(host: str, pid: int, started: str = "", job: str = "", restarts: int = 0, beat_age: float = 0.0):
    now = time.time()
    return run_lock.Owner(host, pid, started, job, restarts, now - 600, now - beat_age)


def test_a_second_writer_is_refused_with_the_holder_named(tmp_path, live_pid):
    me = run_lock.this_process()
    place(tmp_path, holder_on(me.host, live_pid, run_lock.process_start(live_pid), job="4242"))
    with pytest.raises(UserError, match=f"in use by another training: pid {live_pid} on {me.host}, Slurm job 4242"):
        run_lock.acquire(tmp_path, me)
    assert f"pid {live_pid}" in run_lock.holder(tmp_path)
    assert json.loads((tmp_path / run_lock.LOCK_FILE).read_text())["pid"] == live_pid  # the holder's lock untouched


def test_taken_released_and_free_again(tmp_path):
    assert run_lock.holder(tmp_path) is None
    lock = run_lock.acquire(tmp_path)
    other = dataclasses.replace(run_lock.this_process(), pid=lock.owner.pid)
    with pytest.raises(UserError, match="in use by another training"):  # this very process is alive
        run_lock.acquire(tmp_path, other)
    lock.release()
    assert not (tmp_path / run_lock.LOCK_FILE).exists() and run_lock.holder(tmp_path) is None
    assert not list(tmp_path.glob(".*tmp"))  # no temporary file left behind


def test_a_dead_pid_on_this_host_is_taken_over(tmp_path, caplog):
    caplog.set_level(logging.WARNING, "hpctrain")
    me = run_lock.this_process()
    gone = dead_pid()
    place(tmp_path, holder_on(me.host, gone, "123@boot"))
    assert run_lock.holder(tmp_path) is None
    lock = run_lock.acquire(tmp_path, me)
    assert json.loads((tmp_path / run_lock.LOCK_FILE).read_text())["token"] == me.token
    assert f"took over the lock of pid {gone}" in caplog.text
    lock.release()


def test_a_reused_pid_is_not_the_holder(tmp_path, live_pid):
    """The pid is alive, but it started at another time than the holder's: another process now has that number."""
    me = run_lock.this_process()
    place(tmp_path, holder_on(me.host, live_pid, "1@another-boot"))
    run_lock.acquire(tmp_path, me).release()


def test_another_hosts_lock_lives_while_it_beats(tmp_path, monkeypatch):
    me = run_lock.this_process()
    place(tmp_path, holder_on("node7", 99, beat_age=run_lock.STALE_S / 2))
    with pytest.raises(UserError, match="pid 99 on node7"):
        run_lock.acquire(tmp_path, me)
    place(tmp_path, holder_on("node7", 99, beat_age=run_lock.STALE_S + 1))
    run_lock.acquire(tmp_path, me).release()


@pytest.mark.parametrize("job, restarts, taken", [("812", 2, True), ("812", 1, False), ("813", 5, False),
                                                  ("", 2, False)])
def test_a_requeued_job_takes_over_from_its_earlier_start(tmp_path, job, restarts, taken):
    """Slurm requeued job 812 onto another node: its restart count is higher, the lock's heartbeat still fresh."""
    place(tmp_path, holder_on("node3", 4711, job="812", restarts=1))
    me = dataclasses.replace(run_lock.this_process(), job_id=job, restarts=restarts)
    if taken:
        run_lock.acquire(tmp_path, me).release()
    else:
        with pytest.raises(UserError, match="Slurm job 812"):
            run_lock.acquire(tmp_path, me)


def test_the_holder_beats_and_leaves_a_lock_taken_over_alone(tmp_path, monkeypatch):
    monkeypatch.setattr(run_lock, "BEAT_S", 0.05)
    lock = run_lock.acquire(tmp_path)
    first = lock.owner.beat
    deadline = time.time() + 10
    while json.loads((tmp_path / run_lock.LOCK_FILE).read_text())["beat"] == first and time.time() < deadline:
        time.sleep(0.05)
    assert json.loads((tmp_path / run_lock.LOCK_FILE).read_text())["beat"] > first
    thief = run_lock.Owner("node9", 1, "", since=time.time(), beat=time.time())
    place(tmp_path, thief)  # judged dead and taken over (a frozen holder): the new holder's lock must survive
    lock.release()
    assert json.loads((tmp_path / run_lock.LOCK_FILE).read_text())["token"] == thief.token


def test_an_unreadable_lock_says_what_to_do(tmp_path):
    (tmp_path / run_lock.LOCK_FILE).write_text("{not json")
    with pytest.raises(UserError, match="(?s)not readable.*delete it"):
        run_lock.acquire(tmp_path)


def test_a_lock_written_by_a_later_hpctrain_is_still_read(tmp_path, live_pid):
    me = run_lock.this_process()
    place(tmp_path, holder_on(me.host, live_pid, run_lock.process_start(live_pid)))
    data = json.loads((tmp_path / run_lock.LOCK_FILE).read_text()) | {"gpu_count": 8}
    (tmp_path / run_lock.LOCK_FILE).write_text(json.dumps(data))
    assert f"pid {live_pid}" in run_lock.holder(tmp_path)
