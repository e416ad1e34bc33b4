"""One writer per run dir (fault/run_lock.py): a live holder is named and refused, a dead one's lock taken over (a
gone pid, a reused pid, a stale heartbeat from another host by the file server's clock, a Slurm job that has ended,
our own job requeued), only the holder removes it, and a holder that lost its lock stops training."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
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


def place(run_dir: Path, owner: run_lock.Owner, age: float | None = None) -> None:
    """The lock file as ``owner`` wrote it, last written ``age`` seconds ago (default: at its beat)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / run_lock.LOCK_FILE
    path.write_text(json.dumps(dataclasses.asdict(owner)))
    written = time.time() - age if age is not None else owner.beat or time.time()
    os.utime(path, (written, written))


def take_over(run_dir: Path, thief: run_lock.Owner) -> None:
    """Take the lock as another process judging its holder dead does (under the guard): a plain write could land
    between a beat's check and its rewrite, and be overwritten."""
    path = run_dir / run_lock.LOCK_FILE
    deadline = time.time() + 30
    while not run_lock._take_over(path, run_lock.read_owner(path), thief):
        assert time.time() < deadline, "could not take the lock over"
        time.sleep(0.01)


@pytest.fixture(autouse=True)
def no_real_slurm(request, monkeypatch):
    """Slurm's word on a holder's job comes from the stand-in scontrol only: on a Slurm node the real one would answer
    'Invalid job id' (ended) for the tests' made-up jobs. Without the stand-in, Slurm cannot tell."""
    monkeypatch.setattr(run_lock, "_cluster", [])
    if "scontrol" not in request.fixturenames:
        monkeypatch.setattr(run_lock, "_holder_job", lambda holder: "")


@pytest.fixture
def scontrol(tmp_path, monkeypatch):
    """A stand-in scontrol on PATH: writes its answer (stdout), its error (stderr) and its exit code from files;
    'show config' answers ClusterName from the file scontrol-cluster (fails when there is none)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    answer = tmp_path / "scontrol-answer"
    answer.write_text("RUNNING")
    (bin_dir / "scontrol").write_text(
        "#!/bin/sh\n"
        f"if [ \"$2\" = config ]; then [ -f {tmp_path}/scontrol-cluster ] || exit 1; "
        f"echo \"ClusterName             = $(cat {tmp_path}/scontrol-cluster)\"; exit 0; fi\n"
        f"a=$(cat {answer})\n"
        "case \"$a\" in\n"
        "  INVALID) echo 'slurm_load_jobs error: Invalid job id specified' >&2; exit 1;;\n"
        "  TIMEOUT) echo 'slurm_load_jobs error: Socket timed out on send/recv operation' >&2; exit 1;;\n"
        "esac\n"
        "echo \"JobId=$4 JobName=x JobState=$a Reason=None\"\n")
    (bin_dir / "scontrol").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    monkeypatch.delenv("SLURM_CLUSTER_NAME", raising=False)
    return answer


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


@pytest.mark.parametrize("beat_age, written_ago, dead", [
    (run_lock.STALE_S + 600, 5.0, False),   # its clock runs 10 minutes behind ours, and it wrote the file just now
    (0.0, run_lock.STALE_S + 60, True)])    # its clock runs ahead: the beat looks fresh, the file is not
def test_another_hosts_heartbeat_is_judged_by_the_file_servers_clock(tmp_path, beat_age, written_ago, dead):
    """The lock file's age is its mtime against a probe file's, both set by the file server: the hosts' clocks
    (the holder's 'beat', our time.time()) play no part."""
    place(tmp_path, holder_on("node7", 99, beat_age=beat_age), age=written_ago)
    assert (run_lock.holder(tmp_path) is None) == dead
    assert not list(tmp_path.glob(".*probe*"))  # the probe is removed again


@pytest.mark.parametrize("answer, dead", [("COMPLETED", True), ("CANCELLED", True), ("INVALID", True),
                                          ("RUNNING", False), ("COMPLETING", False), ("TIMEOUT", False)])
def test_a_holder_whose_slurm_job_has_ended_is_dead_at_once(tmp_path, scontrol, answer, dead):
    """Rank 0 SIGKILLed at the end of KillWait leaves a fresh heartbeat: Slurm's word that the job has ended (or no
    longer exists) frees the run dir at once. A controller that does not answer says nothing: the heartbeat
    decides (fresh here: alive)."""
    scontrol.write_text(answer)
    place(tmp_path, holder_on("node7", 99, job="4100"))
    assert (run_lock.holder(tmp_path) is None) == dead
    if dead:
        run_lock.acquire(tmp_path, run_lock.this_process()).release()


def test_a_suspended_holder_lives_however_long_it_is_silent(tmp_path, scontrol):
    scontrol.write_text("SUSPENDED")
    place(tmp_path, holder_on("node7", 99, job="4100", beat_age=3 * run_lock.STALE_S))
    assert "Slurm job 4100" in run_lock.holder(tmp_path)
    scontrol.write_text("RUNNING")  # running, and silent for longer than STALE_S: judged dead by its heartbeat
    assert run_lock.holder(tmp_path) is None


def test_another_clusters_job_id_is_not_asked_here(tmp_path, scontrol, monkeypatch):
    monkeypatch.setenv("SLURM_CLUSTER_NAME", "here")
    scontrol.write_text("INVALID")
    place(tmp_path, dataclasses.replace(holder_on("node7", 99, job="4100"), cluster="there"))
    assert "Slurm job 4100" in run_lock.holder(tmp_path)


@pytest.mark.parametrize("config_says, dead", [("there", True), ("here", False), (None, False)])
def test_outside_a_job_the_cluster_comes_from_slurms_config(tmp_path, scontrol, config_says, dead):
    """On a login node (no SLURM_CLUSTER_NAME) another cluster's job id is not asked of this cluster's Slurm, which
    would call it 'Invalid' (ended): the cluster's name comes from 'scontrol show config'; unknown, it cannot tell."""
    scontrol.write_text("INVALID")
    if config_says is not None:
        (tmp_path / "scontrol-cluster").write_text(config_says)
    place(tmp_path / "run", dataclasses.replace(holder_on("node7", 99, job="4100"), cluster="there"))
    described = run_lock.holder(tmp_path / "run")
    assert (described is None) == dead, described


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
    take_over(tmp_path, thief)  # judged dead and taken over (a frozen holder): the new holder's lock must survive
    lock.release()
    assert json.loads((tmp_path / run_lock.LOCK_FILE).read_text())["token"] == thief.token


def test_a_holder_that_lost_its_lock_says_so_and_stops_beating(tmp_path, monkeypatch):
    monkeypatch.setattr(run_lock, "BEAT_S", 0.05)
    lock = run_lock.acquire(tmp_path)
    thief = run_lock.Owner("node9", 1, "", job_id="777", since=time.time(), beat=time.time())
    take_over(tmp_path, thief)
    deadline = time.time() + 30
    while not lock.lost and time.time() < deadline:
        time.sleep(0.05)
    assert "now held by pid 1 on node9, Slurm job 777" in lock.lost
    lock._thread.join(timeout=10)
    assert not lock._thread.is_alive()
    assert json.loads((tmp_path / run_lock.LOCK_FILE).read_text())["token"] == thief.token
    lock.release()


def test_the_beat_waits_while_a_take_over_holds_the_guard(tmp_path, monkeypatch):
    """The beat's check and rewrite run under the take-over guard: a take-over landing between the two would be
    overwritten by the old holder's token."""
    monkeypatch.setattr(run_lock, "BEAT_S", 0.05)
    lock = run_lock.acquire(tmp_path)
    guard = tmp_path / (run_lock.LOCK_FILE + run_lock.GUARD_SUFFIX)
    guard.write_text("{}")  # another process is taking over
    written = (tmp_path / run_lock.LOCK_FILE).read_text()
    time.sleep(1.0)  # twenty beats
    assert (tmp_path / run_lock.LOCK_FILE).read_text() == written
    guard.unlink()
    deadline = time.time() + 30
    while (tmp_path / run_lock.LOCK_FILE).read_text() == written and time.time() < deadline:
        time.sleep(0.05)
    assert json.loads((tmp_path / run_lock.LOCK_FILE).read_text())["beat"] > json.loads(written)["beat"]
    lock.release()


def test_a_read_error_of_the_lock_is_not_a_lost_lock(tmp_path, monkeypatch):
    """A flaky mount (every other read of the lock fails with EIO) tells nothing: the lock stays this run's."""
    import errno

    monkeypatch.setattr(run_lock, "BEAT_S", 3600.0)
    lock = run_lock.acquire(tmp_path)
    reads = []
    real_read_bytes, real_read_text = Path.read_bytes, Path.read_text

    def flaky(real):
        def read(self, *args, **kwargs):
            if self.name == run_lock.LOCK_FILE:
                reads.append(self)
                if len(reads) % 2 == 0:
                    raise OSError(errno.EIO, "Input/output error")
            return real(self, *args, **kwargs)
        return read

    monkeypatch.setattr(Path, "read_bytes", flaky(real_read_bytes))
    monkeypatch.setattr(Path, "read_text", flaky(real_read_text))
    for _ in range(4):
        assert lock.check() == ""
    assert len(reads) >= 4 and not lock.lost
    monkeypatch.undo()
    lock.release()


def test_content_that_is_not_a_lock_is_lost_only_when_seen_twice_in_a_row(tmp_path, monkeypatch):
    monkeypatch.setattr(run_lock, "BEAT_S", 3600.0)
    lock = run_lock.acquire(tmp_path)
    path = tmp_path / run_lock.LOCK_FILE
    good = path.read_text()
    path.write_text('{"host": "no')  # once (a torn read): can't tell
    assert lock.check() == ""
    path.write_text(good)
    assert lock.check() == ""
    path.write_text("garbage")
    assert lock.check() == ""
    assert "replaced by a file that is not a lock" in lock.check()
    lock.release()
    assert path.read_text() == "garbage"  # not ours to remove


def test_a_beat_that_stalled_while_the_lock_was_taken_over_counts_it_as_lost(tmp_path, monkeypatch):
    """The beat's rewrite hung past GUARD_STALE_S: a taker removed its guard as stale, took the guard and the lock;
    the beat's delayed rename then put the old lock back. The beat must see its guard gone: lost, and the taker's
    guard left alone."""
    monkeypatch.setattr(run_lock, "BEAT_S", 0.05)
    thief = run_lock.Owner("node9", 1, "", since=time.time(), beat=time.time())
    path = tmp_path / run_lock.LOCK_FILE
    guard = tmp_path / (run_lock.LOCK_FILE + run_lock.GUARD_SUFFIX)
    real_write_over = run_lock._write_over
    stalled = []

    def stalled_write(target, owner):
        if not stalled:
            stalled.append(owner)
            guard.unlink()  # the taker: our guard is stale to it
            assert run_lock._create(guard, thief)
            real_write_over(target, thief)
        return real_write_over(target, owner)  # our rename, delayed: the old token is back

    lock = run_lock.acquire(tmp_path)
    monkeypatch.setattr(run_lock, "_write_over", stalled_write)
    deadline = time.time() + 30
    while not lock.lost and time.time() < deadline:
        time.sleep(0.05)
    assert stalled and "stalled" in lock.lost, lock.lost
    assert json.loads(guard.read_text())["token"] == thief.token  # the taker's guard stays
    lock.release()


def test_a_take_over_gives_up_when_the_holder_beat_since_it_was_judged(tmp_path):
    old = holder_on("node7", 99, beat_age=run_lock.STALE_S + 1)
    place(tmp_path, old)
    me = run_lock.this_process()
    place(tmp_path, dataclasses.replace(old, beat=time.time()))  # the holder beat after we judged it dead
    assert not run_lock._take_over(tmp_path / run_lock.LOCK_FILE, old, me)
    assert json.loads((tmp_path / run_lock.LOCK_FILE).read_text())["token"] == old.token


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


def test_a_training_whose_lock_is_taken_over_stops_with_an_error_and_saves_nothing(tmp_path, monkeypatch, capsys):
    """A holder judged dead while alive (stopped, a hung mount) wakes to find its lock taken: its beat thread says
    so, the step vote stops every rank with an error naming the new holder, and no checkpoint is written after."""
    import threading

    from hpctrain.cli import main
    from hpctrain.train import loop

    monkeypatch.setattr(run_lock, "BEAT_S", 0.05)
    path = tmp_path / "run" / run_lock.LOCK_FILE
    thief = run_lock.Owner("node9", 1, "", job_id="777", since=time.time(), beat=time.time())
    stolen = threading.Event()
    real_save = loop._save

    def save_then_hold(ctx, window, wait) -> None:  # training holds still after its first save until the theft
        real_save(ctx, window, wait)
        stolen.wait(timeout=120)

    monkeypatch.setattr(loop, "_save", save_then_hold)

    def steal() -> None:  # once the training holds the lock and has saved a checkpoint
        deadline = time.time() + 240
        while time.time() < deadline and not list((tmp_path / "run" / "checkpoints").glob("step_*")):
            time.sleep(0.02)
        take_over(tmp_path / "run", thief)
        stolen.set()

    thread = threading.Thread(target=steal, daemon=True)
    thread.start()
    code = main(["train", "digits", f"run.dir={tmp_path / 'run'}", "train.max_steps=300", "ckpt.every_steps=2",
                 "ckpt.async_save=false", "log.every_steps=1", "log.plots=false", "log.tensorboard=false",
                 "data.num_workers=0", "eval.every_steps=0"])
    thread.join(timeout=10)
    assert stolen.is_set()
    err = capsys.readouterr().err
    assert code == 2, err
    assert "lost its lock (now held by pid 1 on node9, Slurm job 777" in err and "without saving" in err, err[-1500:]
    saved = sorted(int(p.name.split("_")[-1]) for p in (tmp_path / "run" / "checkpoints").glob("step_*"))
    steps = [json.loads(line)["step"] for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert saved == [2], saved  # the first, before the theft (training held still until it), and none after
    assert max(steps) < 100, steps  # stopped within a few steps, not at the run's end
    assert json.loads(path.read_text())["token"] == thief.token  # the new holder's lock is left alone


@pytest.mark.parametrize("async_save", ["true", "false"])
def test_a_save_begun_before_a_take_over_is_not_committed_after_it(tmp_path, monkeypatch, capsys, async_save):
    """The lock is checked when a save starts, and again right before its commit (rename, ``latest``): a save that
    was being written while another training took the run dir (in the background writer, or a slow synchronous
    write) is dropped, not renamed into place over the new holder's run dir."""
    import threading

    from hpctrain.checkpoint import storage
    from hpctrain.checkpoint.manager import Checkpointer
    from hpctrain.cli import main

    monkeypatch.setattr(run_lock, "BEAT_S", 0.05)
    run = tmp_path / "run"
    thief = run_lock.Owner("node9", 1, "", job_id="777", since=time.time(), beat=time.time())
    stolen = threading.Event()
    real_write = Checkpointer._write_tensors
    writes = []

    def write_held(self, *args, **kwargs):  # the second save's write lasts until the lock is taken over
        writes.append(args[0])
        if len(writes) == 2:
            stolen.wait(timeout=120)
        return real_write(self, *args, **kwargs)

    monkeypatch.setattr(Checkpointer, "_write_tensors", write_held)

    def steal() -> None:
        deadline = time.time() + 240
        while time.time() < deadline and len(writes) < 2:
            time.sleep(0.02)
        take_over(run, thief)
        stolen.set()

    thread = threading.Thread(target=steal, daemon=True)
    thread.start()
    code = main(["train", "digits", f"run.dir={run}", "train.max_steps=300", "ckpt.every_steps=2",
                 f"ckpt.async_save={async_save}", "log.every_steps=1", "log.plots=false", "log.tensorboard=false",
                 "data.num_workers=0", "eval.every_steps=0"])
    thread.join(timeout=10)
    assert stolen.is_set()
    err = capsys.readouterr().err
    assert code == 2, err[-1500:]
    assert "lost its lock" in err or "not committed" in err, err[-1500:]
    saved = sorted(p.name for p in (run / "checkpoints").glob("step_*"))
    assert saved == [storage.step_dir_name(2)], saved
    assert (run / "checkpoints" / storage.LATEST).read_text().strip() == saved[0]
    assert not list((run / "checkpoints").glob(f"{storage.TMP_PREFIX}*")), "the dropped save's folder is removed"
    assert json.loads((run / run_lock.LOCK_FILE).read_text())["token"] == thief.token
