"""The launcher's side of a script job, without torchrun: a requeue exit held until the siblings (and the other
nodes) have stopped, the stderr tail and its error line, the node's record, and signals left to Slurm."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest

from hpctrain.dist.env import ScriptStep, script_step
from hpctrain.launcher import script_workers
from hpctrain.launcher.failures import last_error_line, outcome_record
from hpctrain.launcher.script_workers import HeldProcess, StderrTail, StopGroup
from hpctrain.launcher.signals import forwarding, restore_handlers

CODES = frozenset({75, 76})


STARTED: list[subprocess.Popen] = []


@pytest.fixture(autouse=True)
def _no_leftover_children():
    """A child a failing test left running is killed (the tests start small Pythons as workers)."""
    yield
    while STARTED:
        proc = STARTED.pop()
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def python(code: str, **kw) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", code], **kw)
    STARTED.append(proc)
    return proc


def settle(held: list[HeldProcess], timeout: float = 20) -> list[int | None]:
    """Poll until every worker is reported ended, as torchrun's monitor loop does."""
    deadline = time.monotonic() + timeout
    while any(h.poll() is None for h in held):
        assert time.monotonic() < deadline, "a held exit was never released"
        time.sleep(0.02)
    return [h.poll() for h in held]


def test_a_requeue_exit_is_held_while_a_sibling_still_saves():
    group = StopGroup(CODES)
    quick = HeldProcess(python("import sys; sys.exit(75)"), group)
    saving = HeldProcess(python("import sys, time; time.sleep(1.5); sys.exit(75)"), group)
    quick._popen.wait()
    assert quick.poll() is None  # torchrun would SIGTERM the saving rank at a non-zero exit it sees
    assert settle([quick, saving]) == [75, 75]


def test_a_siblings_failure_or_a_plain_exit_is_not_held():
    group = StopGroup(CODES)
    stopped = HeldProcess(python("import sys; sys.exit(75)"), group)
    failed = HeldProcess(python("import sys, time; time.sleep(0.5); sys.exit(1)"), group)
    assert settle([stopped, failed]) == [75, 1] and group.released
    done = StopGroup(CODES)
    finished = HeldProcess(python("pass"), done)
    running = HeldProcess(python("import time; time.sleep(30)"), done)
    finished._popen.wait()
    assert finished.poll() == 0  # exit 0 is torchrun's business, held or not
    assert running.poll() is None


def test_the_hold_ends_after_its_grace():
    group = StopGroup(CODES, grace_s=0.5)
    stopped = HeldProcess(python("import sys; sys.exit(76)"), group)
    hung = HeldProcess(python("import time; time.sleep(60)"), group)
    stopped._popen.wait()
    started = time.monotonic()
    while stopped.poll() is None:
        assert time.monotonic() - started < 10
        time.sleep(0.05)
    assert stopped.poll() == 76 and hung.poll() is None


def test_across_nodes_each_waits_for_every_nodes_marker_and_the_first_node_lingers(tmp_path, monkeypatch):
    monkeypatch.setattr(script_workers, "STORE_LINGER_S", 0.3)
    monkeypatch.setattr(script_workers, "NODE_CHECK_S", 0.0)
    first = StopGroup(CODES, ScriptStep(exits_dir=str(tmp_path), node_id=0, num_nodes=2))
    other = StopGroup(CODES, ScriptStep(exits_dir=str(tmp_path), node_id=1, num_nodes=2))
    a, b = HeldProcess(python("import sys; sys.exit(75)"), first), HeldProcess(python("import sys; sys.exit(75)"), other)
    a._popen.wait()
    b._popen.wait()
    assert a.poll() is None and (tmp_path / "node0.stopped").exists()  # node 1 has not said it stopped
    assert b.poll() == 75  # node 0's marker is there: node 1 may go
    assert a.poll() is None  # node 0 hosts the rendezvous store: it goes STORE_LINGER_S later
    time.sleep(0.35)
    assert a.poll() == 75


def test_the_stderr_tail_passes_everything_through_and_keeps_the_end():
    read, write = os.pipe()
    proc = python("import sys\nfor i in range(3000): print('line', i, file=sys.stderr)\n"
                  "raise RuntimeError('the last words')", stderr=subprocess.PIPE)
    tail = StderrTail(proc.stderr, out_fd=write)
    proc.wait()
    text = tail.text()
    os.close(write)
    with os.fdopen(read, "rb") as passed:
        everything = passed.read().decode()
    assert everything.startswith("line 0\n") and "line 2999\n" in everything and everything.endswith(text)
    assert len(text.encode()) <= script_workers.TAIL_BYTES
    assert last_error_line(text) == "RuntimeError: the last words"


def test_the_nodes_record_names_the_first_failure_with_the_scripts_own_error_line():
    err = SimpleNamespace(failures={
        0: SimpleNamespace(pid=10, local_rank=0, exitcode=-signal.SIGTERM, timestamp=5, message=""),
        1: SimpleNamespace(pid=11, local_rank=1, exitcode=1, timestamp=5, message=""),
    })
    tails = {11: "[rank1]: Traceback (most recent call last):\n[rank1]: ValueError: bad batch\n", 10: ""}
    record = outcome_record(err, 1, CODES, lambda pid: tails.get(pid, ""))
    assert record["outcome"] == "failed" and (record["rank"], record["local_rank"]) == (1, 1)
    assert record["error"] == "ValueError: bad batch" and record["others"] == "rank 0 killed by SIGTERM"
    assert outcome_record(err, 75, CODES)["outcome"] == "requeue"
    finished = SimpleNamespace(failures={0: SimpleNamespace(pid=12, local_rank=0, exitcode=-signal.SIGABRT,
                                                             timestamp=5, message="")})
    record = outcome_record(finished, 134, CODES, lambda pid: "epoch 3 loss=0.2\nterminate called without an active "
                                                              "exception\n")
    assert record["error"].startswith("terminate called without an active exception (a torch thread alive while "
                                      "the interpreter ended, pytorch/pytorch#38228")
    assert outcome_record(None, 0, CODES)["outcome"] == "completed"


def test_where_slurm_signals_every_process_the_launcher_passes_nothing_on():
    child = python("import time; time.sleep(30)")
    previous = forwarding(forward=False)
    try:
        os.kill(os.getpid(), signal.SIGUSR2)  # received, not fatal, not passed on
        time.sleep(0.1)
        assert child.poll() is None
    finally:
        restore_handlers(previous)


def test_the_batch_shells_word_to_each_node_launcher():
    env = {"HPCTRAIN_EXITS_DIR": "/r/slurm/exits/42.0", "HPCTRAIN_FORWARD_SIGNALS": "0", "SLURM_NODEID": "1",
           "SLURM_STEP_NUM_NODES": "2"}
    assert script_step(env) == ScriptStep(exits_dir="/r/slurm/exits/42.0", forward_signals=False, node_id=1,
                                          num_nodes=2)
    assert script_step({}) == ScriptStep()


@pytest.mark.parametrize("text, line", [
    ("", ""), ("just a line\n", "just a line"),
    ("Traceback (most recent call last):\nKeyError: 'x'\nW1206 a warning at exit\n", "KeyError: 'x'"),
    ("hpctrain: error: bad input\nHINT: do this\n", "hpctrain: error: bad input"),
])
def test_the_last_error_line_of_a_workers_stderr(text, line):
    assert last_error_line(text) == line
