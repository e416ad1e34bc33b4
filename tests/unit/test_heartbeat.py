"""The watchdog tells frozen ranks from stuck ones, gives slow phases their own limit, and leaves stacks behind."""

import json
import subprocess
import sys
import textwrap
import time
from pathlib import Path

from hpctrain.fault.heartbeat import Heartbeat, Limits, Watchdog, format_stuck, slow_phase_limit, stuck_ranks

LIMITS = Limits(hang_s=50, slow_s=500, beat_s=10)


def beat(rank: int, since: float, written: float, phase: str = "forward", slow: bool = False) -> dict:
    return {"rank": rank, "since": since, "written": written, "phase": phase, "slow": slow, "step": 40,
            "host": f"node{rank}", "pid": 100 + rank}


def test_a_rank_whose_file_is_stale_is_reported_frozen_not_by_its_old_phase():
    now = 1000.0
    alive = beat(0, since=900, written=now - 3, phase="backward")  # waiting in a collective, still writing
    frozen = beat(1, since=880, written=880, phase="start", slow=True)  # its file stopped with it, in a slow phase
    stale = stuck_ranks([alive, frozen], now, LIMITS)
    assert [(b["rank"], b["frozen"]) for b in stale] == [(1, True), (0, False)]
    text = format_stuck(stale)
    assert ("rank 1 on node1 (pid 101): process frozen or stopped (heartbeat not written for 120 s); "
            "last seen in phase 'start' at step 40") in text
    assert "rank 0 on node0 (pid 100): phase 'backward' at step 40, no progress for 100 s" in text
    assert "phase 'start' at step 40, no progress" not in text  # the old phase is not presented as current


def test_slow_phases_get_their_own_limit():
    now = 1000.0
    compiling = beat(0, since=now - 100, written=now, slow=True)
    stuck = beat(1, since=now - 100, written=now)
    saving = beat(2, since=now - 600, written=now, phase="checkpoint", slow=True)
    assert [b["rank"] for b in stuck_ranks([compiling, stuck, saving], now, LIMITS)] == [2, 1]


def test_first_entry_of_a_phase_and_every_checkpoint_are_slow():
    hb = Heartbeat(rank=0, host="h")
    assert hb.slow  # "start": before the first step, restore and set-up
    hb.mark("forward", 0)
    assert hb.slow  # the first forward: torch.compile
    hb.mark("forward", 1)
    assert not hb.slow
    hb.mark("checkpoint", 1)
    hb.mark("checkpoint", 2)
    assert hb.slow
    assert json.loads(json.dumps(hb.snapshot()))["slow"] is True


def test_a_moving_validation_is_not_a_hang_but_a_stuck_one_is(tmp_path: Path):
    seen = []
    hb = Heartbeat(rank=0, host="h")
    dog = Watchdog(hb, tmp_path, every_s=60, hang_timeout_s=1.0, is_main=True, on_hang=seen.append, slow_timeout_s=4.0)
    hb.mark("eval", 5)  # the first validation batch (a recompile): the slow limit
    time.sleep(1.5)
    dog.beat()
    assert not seen
    for _ in range(3):  # a batch every 0.1 s: progress
        time.sleep(0.1)
        hb.mark("eval")
        dog.beat()
    assert not seen
    time.sleep(1.5)
    dog.beat()
    assert len(seen) == 1 and seen[0][0]["phase"] == "eval" and not seen[0][0]["frozen"]
    text = (tmp_path / "stuck_rank_0.txt").read_text()
    assert "All threads" in text and "test_a_moving_validation_is_not_a_hang_but_a_stuck_one_is" in text
    dog.stop()
    assert not dog.frozen_path.exists()  # armed, never fired: removed


def test_a_checkpoint_save_gets_the_control_planes_limit():
    """A save's waits are on the control plane (dist.control_timeout_s): a 12-minute write on a slow file system
    is no hang when the training timeout is 10 minutes; a compile that long is (its peers wait on NCCL)."""
    limits = Limits(hang_s=50, slow_s=slow_phase_limit(1800, 600, 10), beat_s=10,
                    control_slow_s=slow_phase_limit(1800, 3600, 10))
    now = 10_000.0
    saving = beat(0, since=now - 720, written=now, phase="checkpoint", slow=True)
    compiling = beat(1, since=now - 720, written=now, phase="forward", slow=True)
    assert [b["rank"] for b in stuck_ranks([saving, compiling], now, limits)] == [1]
    assert [b["rank"] for b in stuck_ranks([beat(0, since=now - 1900, written=now, phase="checkpoint", slow=True)],
                                           now, limits)] == [0]


def test_the_slow_limit_ends_before_the_collective_timeout():
    """A peer waiting longer than dist.timeout_s fails its collective: the report must come before that."""
    assert slow_phase_limit(1800, collective_timeout_s=600, beat_s=10) == 580
    assert slow_phase_limit(300, collective_timeout_s=600, beat_s=10) == 300


def test_a_frozen_rank_is_stale_by_the_time_its_peers_report():
    assert Limits(hang_s=300, slow_s=0, beat_s=10).frozen_after_s == 32
    assert Limits(hang_s=4, slow_s=0, beat_s=1).frozen_after_s == 3  # reported at 4 s: stale by then


def test_ranks_that_exited_are_not_called_frozen():
    gone = beat(1, since=100, written=100, phase="failed")
    (b,) = stuck_ranks([gone], 1000.0, LIMITS)
    assert not b["frozen"] and "rank 1 on node1 (pid 101): exited (failed) at step 40" in format_stuck([b])


FROZEN = """
import ctypes, sys, time
from pathlib import Path
from hpctrain.fault.heartbeat import Heartbeat, Watchdog

def hold_the_lock_in_c():
    ctypes.PyDLL(None).sleep(3)  # libc sleep through PyDLL keeps the GIL: no Python thread can run

hb = Heartbeat(rank=3, host="h")
dog = Watchdog(hb, Path(sys.argv[1]), every_s=0.2, hang_timeout_s=0.5, is_main=False, slow_timeout_s=60)
hb.mark("forward", 1)  # a slow phase (first entry), yet no Python runs in a frozen process: 0.5 s applies
dog.start()
time.sleep(0.5)
hold_the_lock_in_c()
dog.stop()
"""


def test_a_process_frozen_holding_the_interpreter_lock_still_leaves_all_its_stacks(tmp_path: Path):
    """The Python watchdog cannot run then; faulthandler's C thread, armed by the last beat, can."""
    subprocess.run([sys.executable, "-c", textwrap.dedent(FROZEN), str(tmp_path)], check=True, timeout=60)
    text = (tmp_path / "frozen_rank_3.txt").read_text()
    assert "most recent call first" in text and "hold_the_lock_in_c" in text
    # The frozen main thread and the watchdog; twice if a starved watchdog let the timer fire once before.
    assert text.count("Thread 0x") + text.count("Current thread 0x") in (2, 4)


def test_a_rank_stuck_outside_a_collective_is_named_before_its_waiting_peer():
    """Rank 1 hangs entering its forward a millisecond after rank 0 entered the backward's all-reduce (seen in
    CI): the report names rank 1 first, the likely cause, though rank 0's phase began earlier."""
    now = 1000.0
    waiting = beat(0, since=900.000, written=now - 1, phase="backward")
    hung = beat(1, since=900.001, written=now - 1, phase="forward")
    assert [b["rank"] for b in stuck_ranks([waiting, hung], now, LIMITS)] == [1, 0]
    both_waiting = [beat(0, since=900.0, written=now - 1, phase="sync"), beat(1, since=899.0, written=now - 1, phase="sync")]
    assert [b["rank"] for b in stuck_ranks(both_waiting, now, LIMITS)] == [1, 0]  # then the one that stopped first
