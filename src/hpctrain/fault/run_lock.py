"""One writer per run dir: RUN_DIR/run.lock, taken by rank 0 before it writes anything and released at exit.

Run dirs live on shared file systems (NFS, Lustre) where flock is unreliable across nodes, so the lock is a file
that appears atomically (a hard link of a complete temporary file: it never exists half-written) plus a rule that
says when its holder is provably dead and the lock may be taken over (is_dead: its pid gone on this host, an
earlier start of our own Slurm job, a job Slurm says has ended, or a heartbeat older than STALE_S elsewhere).

A take-over replaces the file under a second, short-lived guard file (run.lock.takeover), so two processes that
both judge a holder dead cannot both win. A holder that was judged dead while alive (stopped with SIGSTOP, a mount
that hung for minutes) finds at its next beat that the lock is no longer its own, and every rank stops with an
error, without a checkpoint (RunLock says how).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import threading
import time
import uuid
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import TYPE_CHECKING, Iterator

from hpctrain.dist.env import restart_count
from hpctrain.errors import UserError, agreed_on_every_rank
from hpctrain.slurm.job import job_liveness, run_slurm

if TYPE_CHECKING:  # torch: not imported by `hpctrain slurm submit`, which asks holder() only
    from hpctrain.dist.runtime import Runtime

log = logging.getLogger("hpctrain")

LOCK_FILE = "run.lock"
GUARD_SUFFIX = ".takeover"
BEAT_S = 30.0
"""How often the holder rewrites its heartbeat into the lock file."""
STALE_S = 300.0
"""A lock from another host whose heartbeat is older than this is a dead holder's (ten missed beats: slow file
systems and clock skew between nodes stay far below it)."""
GUARD_STALE_S = 60.0
"""A take-over guard older than this was left by a process that died while taking over."""


@dataclass(frozen=True)
class Owner:
    """Who holds (or wants) a run dir: what the lock file says, and what its liveness rule reads."""

    host: str
    """socket.gethostname() of the holder."""
    pid: int
    """The holder's process id (rank 0 of its training)."""
    started: str
    """The pid's start time since boot and the boot id (Linux /proc), to tell it from a later process of that pid;
    '' where unknown."""
    job_id: str = ""
    """SLURM_JOB_ID, '' outside Slurm."""
    restarts: int = 0
    """SLURM_RESTART_COUNT: a requeued start of the same job has a higher one."""
    since: float = 0.0
    """When the holder took the lock (epoch seconds)."""
    beat: float = 0.0
    """The holder's last heartbeat (epoch seconds)."""
    token: str = field(default_factory=lambda: uuid.uuid4().hex)
    """Unique per take: a holder rewrites or removes the file only while it is still its own."""
    cluster: str = ""
    """SLURM_CLUSTER_NAME of the holder's job: another cluster's job id means nothing to this cluster's Slurm."""

    def describe(self) -> str:
        job = f", Slurm job {self.job_id}" + (f" (restart {self.restarts})" if self.restarts else "") if self.job_id else ""
        return f"pid {self.pid} on {self.host}{job}, since {time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(self.since))}"


def this_process(job_id: str = "", restarts: int | None = None) -> Owner:
    now = time.time()
    return Owner(socket.gethostname(), os.getpid(), process_start(os.getpid()), job_id,
                 restart_count() if restarts is None else restarts, now, now,
                 cluster=os.environ.get("SLURM_CLUSTER_NAME", "") if job_id else "")


def process_start(pid: int) -> str:
    """'<start ticks>@<boot id>' for a live pid on Linux; '' when the pid is gone or there is no /proc."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return ""
    # The command name (field 2) may hold spaces and parentheses: fields are counted after its closing one.
    return f"{stat[stat.rindex(')') + 2:].split()[19]}@{boot}"


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: alive
        return True
    return True


def is_dead(holder: Owner, me: Owner, path: Path | None = None) -> bool:
    """The liveness rule (see the module's docstring): True only when the holder is provably gone. ``path``: the
    lock file the holder was read from, whose age (file-server time) judges a holder on another host.

    The rule. The holder ran on this host: dead when its pid is gone, or now belongs to another process (another
    start time, or another boot). The holder is an earlier start of our own Slurm job (same SLURM_JOB_ID, lower
    SLURM_RESTART_COUNT): a requeued job takes over from itself at once, on whichever node it lands. The holder ran
    in a Slurm job that Slurm says has ended (or no longer knows: "Invalid job id specified"): dead at once,
    wherever it ran (a rank 0 SIGKILLed at the end of KillWait leaves a fresh heartbeat behind). A suspended job is
    alive, however long it has been silent. Otherwise, the holder ran on another host: dead when its heartbeat (the
    lock file, rewritten every BEAT_S by a thread of the holder) is older than STALE_S. Its age is the lock file's
    mtime against that of a probe file just written beside it, so the judging host's own clock plays no part. On NFS
    both mtimes are the file server's clock; Lustre (and GPFS) stamp a write with the writing client's clock, so
    there the skew between the holder's and the judge's clocks adds to or takes from the age: NTP keeps it far below
    STALE_S, but a node whose clock runs minutes ahead can keep its lock alive that much longer, or one that runs
    behind lose it that much sooner. A node that crashed thus blocks its run dir for STALE_S (plus that skew) at
    most."""
    if holder.host == me.host:
        if not _pid_alive(holder.pid):
            return True
        return bool(holder.started) and process_start(holder.pid) not in ("", holder.started)
    if me.job_id and holder.job_id == me.job_id and holder.restarts < me.restarts:
        return True  # our own job, requeued onto another node
    slurm = _holder_job(holder)
    if slurm in ("ended", "suspended"):
        return slurm == "ended"
    silent = _silent_for(path) if path is not None else None
    return (time.time() - holder.beat if silent is None else silent) > STALE_S


_cluster: list[str] = []
"""This machine's Slurm cluster name from ``scontrol show config``, once known (outside a job, on a login node)."""


def _this_cluster() -> str:
    """SLURM_CLUSTER_NAME (set inside jobs only), else ClusterName from ``scontrol show config`` (asked once per
    process); '' when neither says."""
    here = os.environ.get("SLURM_CLUSTER_NAME", "")
    if here or _cluster:
        return here or _cluster[0]
    try:
        proc = run_slurm(["scontrol", "show", "config"], timeout=30)
    except UserError:
        return ""
    for line in proc.stdout.splitlines() if proc.returncode == 0 else []:
        key, _, value = line.partition("=")
        if key.strip() == "ClusterName" and value.strip():
            _cluster.append(value.strip())
            return _cluster[0]
    return ""


def _holder_job(holder: Owner) -> str:
    """What this cluster's Slurm says of the holder's job: 'ended' (ended or forgotten), 'suspended', 'live', or ''
    when it cannot tell (no Slurm job, no scontrol here, the controller did not answer, another cluster's job, or
    a holder of a named cluster while this machine's cluster is unknown: its job id may be another cluster's)."""
    if not holder.job_id or (holder.cluster and holder.cluster != _this_cluster()):
        return ""
    try:
        return job_liveness(holder.job_id)
    except UserError:  # no Slurm commands on this machine, or no answer: the heartbeat decides
        return ""


def _silent_for(path: Path) -> float | None:
    """Seconds since ``path`` was last written, by the file server's clock: a probe file written beside it now, and
    the two mtimes compared. None when the probe cannot be written or either file cannot be read."""
    probe = path.with_name(f".{path.name}.probe.{uuid.uuid4().hex}")
    try:
        probe.write_text("")
        return probe.stat().st_mtime - path.stat().st_mtime
    except OSError:
        return None
    finally:
        with contextlib.suppress(OSError):
            probe.unlink()


def _parse(data: bytes) -> Owner:
    """A lock file's content as an Owner; ValueError, TypeError or AttributeError when it is not a lock."""
    known = {f.name for f in fields(Owner)}  # a later hpctrain may write more: those are not ours to judge by
    return Owner(**{k: v for k, v in json.loads(data).items() if k in known})


def read_owner(path: Path) -> Owner | None:
    """The lock file's holder; None when there is no lock file. An unreadable one is a UserError that names it."""
    try:
        return _parse(path.read_bytes())
    except FileNotFoundError:
        return None
    except (OSError, ValueError, TypeError, AttributeError) as err:
        raise UserError(f"the run dir's lock {path} is not readable ({err})",
                        "no hpctrain writes such a file: make sure no training uses this run dir, then delete it.") \
            from None


def holder(run_dir: Path, me: Owner | None = None) -> str | None:
    """A description of the live training that holds ``run_dir`` (host, pid, Slurm job, since when); None when it
    is free or its holder is provably dead."""
    path = Path(run_dir) / LOCK_FILE
    owner = read_owner(path)
    if owner is None or is_dead(owner, me or this_process(), path):
        return None
    return owner.describe()


class RunLock:
    """A held run dir lock: a thread rewrites its heartbeat until release(), and sets ``lost`` when it finds the lock
    no longer its own (the training must then stop: the step vote reads it).

    A take-over replaces the file with os.replace under a second, short-lived guard file (run.lock.takeover), so two
    processes that both judge a holder dead cannot both win; the holder's heartbeat rewrites the file under the same
    guard, and a take-over gives up when the lock changed since it was judged (a beat in between: alive after all).

    A holder that was judged dead while alive finds at its next beat that the lock is no longer its own: the step
    vote (fault/vote.py) then stops every rank with an error, without a checkpoint; rank 0 checks the lock before
    each checkpoint, and again right before one is committed (renamed into place, ``latest`` moved), in the
    background writer too. A beat that stalled inside its rewrite for longer than GUARD_STALE_S (its guard then
    removed as stale by a taker) may have put its old lock back over a take-over: it finds its guard gone after the
    rewrite and counts the lock as lost (the taker, whose lock it overwrote, stops at its own next beat: both stop,
    neither writes on)."""

    def __init__(self, path: Path, owner: Owner) -> None:
        self.path = path
        self.owner = owner
        self.lost = ""
        """'' while the lock is ours; once it is not: who holds it now (or that it was removed)."""
        self._unparseable = 0
        """Checks in a row that read content that is not a lock (two make it lost: one may be a torn read)."""
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat, name="hpctrain-run-lock", daemon=True)
        self._thread.start()

    def _beat(self) -> None:
        while not self._stop.wait(BEAT_S):
            if not self._beat_once():
                return

    def _beat_once(self) -> bool:
        """One heartbeat; False once the lock is lost (the beats end)."""
        try:
            # Under the take-over guard: a take-over cannot land between the check and the rewrite.
            with _guarded(self.path, self.owner) as guarded:
                if not guarded:
                    return True  # a take-over under way: the next beat sees its outcome
                if not self.check():
                    self.owner = _write_over(self.path, _with_beat(self.owner))
                    if _guard_of(self.path) not in (self.owner.token, None):
                        # The rewrite stalled past GUARD_STALE_S and a taker removed our guard as stale: our
                        # rename may have put this lock back over its take-over.
                        self.lost = (f"this run's heartbeat stalled over {GUARD_STALE_S:.0f} s in rewriting "
                                     f"{self.path} and another process may have taken it over meanwhile")
        except OSError as err:  # a flaky mount: the next beat tries again, and STALE_S allows ten misses
            log.warning("could not refresh the run dir lock %s: %s", self.path, err)
        if self.lost:
            log.error("run dir lock %s is no longer this run's: %s; every rank stops at the next step",
                      self.path, self.lost)
            return False
        return True

    def check(self) -> str:
        """'' while the lock file is still this holder's; else who holds it now (also kept in ``lost``). A read
        that fails (EIO, ESTALE on a flaky mount) tells nothing: ''."""
        if not self.lost:
            try:
                data = self.path.read_bytes()
            except FileNotFoundError:
                self.lost = f"{self.path} was removed"
                return self.lost
            except OSError:
                return ""
            try:
                current = _parse(data)
            except (ValueError, TypeError, AttributeError):
                self._unparseable += 1
                if self._unparseable >= 2:
                    self.lost = f"{self.path} was replaced by a file that is not a lock"
                return self.lost
            self._unparseable = 0
            if current.token != self.owner.token:
                self.lost = f"now held by {current.describe()}"
        return self.lost

    def release(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        with contextlib.suppress(OSError), _guarded(self.path, self.owner) as guarded:
            if guarded and not self.check():  # never another holder's lock (a take-over cannot land in between)
                self.path.unlink()


def _guard_of(path: Path) -> str | None:
    """The token of whoever holds the take-over guard beside ``path``: '' when there is none (or it is not
    readable as a lock), None when it cannot be read (a flaky mount: can't tell)."""
    try:
        return _parse(path.with_name(path.name + GUARD_SUFFIX).read_bytes()).token
    except FileNotFoundError:
        return ""
    except OSError:
        return None
    except (ValueError, TypeError, AttributeError):
        return ""


def _with_beat(owner: Owner) -> Owner:
    return replace(owner, beat=time.time())


def _tmp_with(path: Path, owner: Owner) -> Path:
    tmp = path.with_name(f".{path.name}.{owner.token}.tmp")
    tmp.write_text(json.dumps(asdict(owner)) + "\n")
    return tmp


def _write_over(path: Path, owner: Owner) -> Owner:
    tmp = _tmp_with(path, owner)
    try:
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)  # only there when the rename failed
    return owner


def _create(path: Path, owner: Owner) -> bool:
    """Make ``path`` hold ``owner`` if it does not exist; False when it does. A hard link is atomic on NFS and
    Lustre, and the file it makes is complete; a file system without hard links gets O_EXCL and a write."""
    tmp = _tmp_with(path, owner)
    try:
        os.link(tmp, path)
        return True
    except FileExistsError:
        return False
    except OSError:
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            return False
        with os.fdopen(fd, "w") as f:
            f.write(tmp.read_text())
        return True
    finally:
        tmp.unlink(missing_ok=True)


def acquire(run_dir: Path, me: Owner | None = None) -> RunLock:
    """Take the run dir for this process, or raise a UserError that names the live holder."""
    me = me or this_process()
    path = Path(run_dir) / LOCK_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    for _ in range(3):  # a holder that releases between our tries: look again
        if _create(path, me):
            return RunLock(path, me)
        current = read_owner(path)
        if current is None:
            continue
        if not is_dead(current, me, path):
            raise busy(path, current)
        if _take_over(path, current, me):
            log.warning("run dir %s: took over the lock of %s, which is no longer running", run_dir,
                        current.describe())
            return RunLock(path, me)
    raise UserError(f"could not take the run dir lock {path}: other processes keep taking it",
                    "make sure only one training writes this run dir, then start again.")


def busy(path: Path, current: Owner) -> UserError:
    stop = (f"'hpctrain slurm cancel {current.job_id}'" if current.job_id else f"kill {current.pid} on {current.host}")
    return UserError(
        f"run dir {path.parent} is in use by another training: {current.describe()}; two trainings in one run dir "
        "would overwrite each other's checkpoints and metrics",
        f"wait for it to end, stop it ({stop}), or choose another run.dir. A holder on another host that died "
        f"without releasing the lock is taken over once Slurm says its job has ended, else {STALE_S / 60:.0f} "
        f"minutes after its last heartbeat; if you know it is gone, delete {path}.")


def lost_error(run_dir: Path, why: str) -> UserError:
    """Every rank's error when the run dir's lock stopped being this training's while it ran."""
    return UserError(
        f"run dir {run_dir}: this training lost its lock ({why}) while it ran, so another training may be writing "
        "the run dir; stopped without saving, so the two do not overwrite each other's checkpoints and metrics",
        "the lock is taken over when its holder is judged dead: this run was silent for over "
        f"{STALE_S / 60:.0f} minutes (stopped, suspended outside Slurm, a hung file system) or its Slurm job was "
        "reported ended. Let the other training finish or stop it, then resume from the run dir's latest checkpoint.")


@contextlib.contextmanager
def _guarded(path: Path, me: Owner) -> Iterator[bool]:
    """Hold the take-over guard beside ``path`` for the block (True), or False when another process holds it."""
    guard = path.with_name(path.name + GUARD_SUFFIX)
    if not _create(guard, me):
        with contextlib.suppress(OSError):
            silent = _silent_for(guard)
            if silent is not None and silent > GUARD_STALE_S:
                guard.unlink()  # left by a process that died taking over: the next try may take it
        yield False
        return
    try:
        yield True
    finally:
        if _guard_of(path) in (me.token, None):  # not another's, that removed ours as stale and took the guard
            guard.unlink(missing_ok=True)


def _take_over(path: Path, dead: Owner, me: Owner) -> bool:
    """Replace a dead holder's lock with ours; False when another process got there first, or the lock changed
    since it was judged (released, taken by another, or the holder beat: alive after all)."""
    with _guarded(path, me) as guarded:
        if not guarded:
            return False
        current = read_owner(path)
        if current is None or current != dead:
            return False
        _write_over(path, me)
        return True


@contextlib.contextmanager
def hold_run_dir(run_dir: Path, runtime: Runtime) -> Iterator[RunLock | None]:
    """Rank 0 takes the lock before anything is written; its verdict goes to every rank on the control plane, so
    all stop with the holder's name when it cannot (none waits in a collective for a rank 0 that quit)."""
    from hpctrain.dist.collectives import broadcast_object

    lock, refusal = None, ("", "")
    if runtime.is_main:
        try:
            lock = acquire(run_dir, this_process(runtime.job_id))
        except UserError as err:
            refusal = (str(err.args[0]), err.hint)
    refusal = broadcast_object(refusal, runtime)
    if refusal[0]:
        raise agreed_on_every_rank(UserError(*refusal))
    try:
        yield lock
    finally:
        if lock is not None:
            lock.release()
