"""A tracker as a MetricsLogger sink: the training thread only puts records into a bounded queue; one thread per
tracker opens the tracker run and sends, so a slow or unreachable tracker never stalls a step.

Which records are sent, and when, is what keeps one tracker run equal to metrics.jsonl across resumes. Neither
tracker can take records back in general (MLflow has no call that deletes metric history, mlflow/mlflow#2973; W&B's
rewind is a private preview of its server and does nothing offline), so hpctrain sends nothing a resume could
redo: a step's records go out once a committed checkpoint holds that step (``durable_step``) and the step is
complete: a record of a later step has come, or the run has reached its last step. A crash after the last
checkpoint then leaves no records of the lost steps in the tracker, and the resumed run sends them once. The
price: the tracker shows the run up to its latest checkpoint (ckpt.every_steps, ckpt.every_minutes), and all of
it at the end. A launch that ends before the run's end keeps its last step back: the next launch may add to it
(the validation a stop skipped), and sends it whole.

The state file (state.py) keeps the last step sent. A launch that starts at step S and finds it below S takes the
records between them from metrics.jsonl first (the step kept back, or steps an earlier launch could not send:
killed with its queue full, or its tracker down); one that finds it above S (a resume from an older checkpoint
than the newest, e.g. a damaged latest one, or ckpt.resume=PATH) leaves the steps the tracker has as they are,
sends none of them again, and marks the run (decide_start). What the tracker does not get is in metrics.jsonl,
the record of the run.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import queue
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Protocol

import numpy as np

from hpctrain.metrics.records import EVENTS, metric_values, read_metrics
from hpctrain.metrics.trackers.state import TrackerState, read_state, write_state
from hpctrain.threads import lower_priority

log = logging.getLogger("hpctrain")

QUEUE_SIZE = 20_000
"""Records and images a tracker may be behind before it drops them (about 30 MB of sample grids at most)."""


class Client(Protocol):
    """One tracker's calls, made from the sink's thread only."""

    name: str

    def open(self, state: TrackerState) -> TrackerState:
        """Create or continue the run of ``state`` (its run_id, else its uid); the state with the run's id."""

    def send(self, step: int, values: dict[str, float], times: dict[str, float],
             images: list[tuple[str, np.ndarray]]) -> None:
        """One complete step: its metrics ('train/loss': value, with each one's Unix time) and pictures."""

    def mark_redone(self, start_step: int, sent_step: int) -> None:
        """Note on the run that steps start_step+1..sent_step are from an earlier launch (decide_start)."""

    def close(self, complete: bool) -> None:
        """End the launch's connection; ``complete``: the training reached its last step."""

    def note(self) -> str:
        """Where the run is, for the end of the job's log (W&B offline: the `wandb sync` command)."""


@dataclass(frozen=True, kw_only=True)
class StartPlan:
    """What a launch starting at a step does with the steps its tracker already has."""

    catch_up: tuple[int, int] | None = None
    """(after, through): metrics.jsonl's records of these steps go out first (the tracker does not have them)."""
    skip_through: int = 0
    """Records up to this step are not sent: the tracker has them (from an earlier launch)."""
    redone: bool = False
    """The resume went back behind what the tracker has: the run is marked."""


def decide_start(sent_step: int, start_step: int) -> StartPlan:
    """Pure: the plan for a launch at ``start_step`` whose tracker has every record up to ``sent_step``."""
    if sent_step < start_step:
        return StartPlan(catch_up=(sent_step, start_step), skip_through=sent_step)
    return StartPlan(skip_through=sent_step, redone=sent_step > start_step)


@dataclass
class _Step:
    values: dict[str, float] = field(default_factory=dict)
    times: dict[str, float] = field(default_factory=dict)
    images: list[tuple[str, np.ndarray]] = field(default_factory=list)


def tracker_values(record: dict[str, Any]) -> dict[str, float]:
    """A metrics record as tracker keys, as TensorBoard names them: {'train/loss': 0.52, 'val/accuracy': 0.9};
    nothing for the event splits (stop, resume)."""
    if record.get("split") in EVENTS:
        return {}
    return {f"{record['split']}/{key}": float(value) for key, value in metric_values(record).items()}


_CLOSE = object()


class TrackerSink:
    """A Sink and ImageSink of MetricsLogger for one tracker (rank 0's)."""

    def __init__(self, client: Client, run_dir: Path, start_step: int, total_steps: int,
                 durable_step: Callable[[], int] | None, timeout_s: float) -> None:
        self.client = client
        self.run_dir = run_dir
        self.start_step = start_step
        self.total_steps = total_steps
        self.durable_step = durable_step
        """The newest committed checkpoint's step; None: nothing can resume from a checkpoint, send at once."""
        self.timeout_s = timeout_s
        self.queue: queue.Queue = queue.Queue(maxsize=QUEUE_SIZE)
        self.failed = ""
        """Why this tracker stopped for this launch ('' while it works)."""
        self.dropped_from = 0
        """The first step whose record did not fit the queue (0: none); nothing from it on is sent this launch."""
        self.sent_step = 0
        self.complete = False
        self._warned = False
        self._warning = threading.Lock()
        """A tracker that is down warns once: its failure, or the end's given-up wait, whichever comes first (a
        daemon thread still retrying can fail after the end gave up on it, while the process exits)."""
        self.thread = threading.Thread(target=self._run, name=f"hpctrain-tracker-{client.name}", daemon=True)
        self.thread.start()

    # ---- the training thread's side: never blocks --------------------------------------------------------------

    def write(self, record: dict[str, Any]) -> None:
        values = tracker_values(record)
        if values:
            self._put((int(record["step"]), values, float(record.get("time", 0.0)), None))

    def write_image(self, tag: str, step: int, image: np.ndarray) -> None:
        self._put((int(step), {}, 0.0, (tag, image)))

    def _put(self, item: tuple) -> None:
        if self.failed or self.dropped_from:
            return
        try:
            self.queue.put_nowait(item)
        except queue.Full:
            self.dropped_from = item[0]
            log.warning("tracker %s is %d records behind: records from step %d on are not sent in this launch "
                        "(metrics.jsonl has them; the run's next launch sends them)", self.client.name, QUEUE_SIZE,
                        item[0])

    def close(self) -> None:
        """Send what is due and end, waiting at most log.tracker_timeout_s; what is left is in metrics.jsonl."""
        deadline = time.monotonic() + self.timeout_s
        try:
            self.queue.put(_CLOSE, timeout=self.timeout_s)
        except queue.Full:
            pass
        self.thread.join(max(0.0, deadline - time.monotonic()))
        if self.thread.is_alive():
            self._warn_once("tracker %s did not finish within log.tracker_timeout_s=%g s; what it has not sent is in "
                            "metrics.jsonl and goes out at the run's next launch", self.client.name, self.timeout_s)
        elif not self.failed and self.client.note():
            log.info("tracker %s: %s", self.client.name, self.client.note())

    # ---- the tracker's thread -----------------------------------------------------------------------------------

    def _run(self) -> None:
        lower_priority()  # before the client starts its helper processes (wandb-core inherits it)
        pending: dict[int, _Step] = {}
        try:
            plan = self._open()
            if plan.catch_up:
                self._catch_up(pending, *plan.catch_up)
            closing = False
            while not closing:
                closing = self._collect(pending, plan.skip_through)
                self._deliver(pending, closing)
            self.client.close(self.complete)
        except Exception as err:  # noqa: BLE001 - a tracker's failure is never the training's
            self._fail(err)

    def _open(self) -> StartPlan:
        state = read_state(self.run_dir, self.client.name) or TrackerState()
        write_state(self.run_dir, self.client.name, state)  # the uid first: a launch dying in open() finds the run
        state = self.client.open(state)
        plan = decide_start(state.sent_step, self.start_step)
        if plan.redone:
            self.client.mark_redone(self.start_step, state.sent_step)
            log.warning("tracker %s holds steps up to %d, and this run resumes at step %d (an older checkpoint than "
                        "the newest): steps %d-%d keep the values of the earlier launch there, marked on the run; "
                        "metrics.jsonl has this launch's", self.client.name, state.sent_step, self.start_step,
                        self.start_step + 1, state.sent_step)
        self.sent_step = state.sent_step
        self.state = state
        write_state(self.run_dir, self.client.name, state)
        return plan

    def _catch_up(self, pending: dict[int, _Step], after: int, through: int) -> None:
        """metrics.jsonl's records of steps after..through into ``pending``: an earlier launch logged them, the
        tracker does not have them."""
        path = self.run_dir / "metrics.jsonl"
        for record in read_metrics(path) if path.exists() else []:
            if after < record["step"] <= through:
                _add(pending, record["step"], tracker_values(record), float(record.get("time", 0.0)), None)

    def _collect(self, pending: dict[int, _Step], skip_through: int) -> bool:
        """Move queued items into ``pending`` (waiting up to 1 s for the first); True once close() was asked."""
        try:
            item = self.queue.get(timeout=1.0)
        except queue.Empty:
            return False
        while True:
            if item is _CLOSE:
                return True
            step, values, when, image = item
            if step > skip_through:
                _add(pending, step, values, when, image)
            try:
                item = self.queue.get_nowait()
            except queue.Empty:
                return False

    def _deliver(self, pending: dict[int, _Step], closing: bool) -> None:
        """Send the complete steps a committed checkpoint holds, oldest first."""
        horizon = self.durable_step() if self.durable_step is not None else math.inf
        newest = max(pending, default=0)
        # An unfinished run's newest step may still grow in its next launch (see above); without checkpoints
        # there is no next launch.
        last_kept = self.durable_step is not None and newest < self.total_steps
        if self.dropped_from:  # records come in step order: every step before the first dropped one is complete
            newest = self.dropped_from
        due = [s for s in sorted(pending) if s <= horizon and (s < newest or (closing and not last_kept))
               and not (self.dropped_from and s >= self.dropped_from)]
        sent = 0
        try:
            for step in due:
                self._send(step, pending.pop(step))
                sent = step
        finally:  # also when a send raised: the steps before it are the tracker's
            if sent:
                self._sent(sent)

    def _send(self, step: int, item: _Step) -> None:
        self.client.send(step, item.values, item.times, item.images)
        self.complete |= step >= self.total_steps

    def _sent(self, step: int) -> None:
        self.sent_step = step
        self.state = dataclasses.replace(self.state, sent_step=step)
        write_state(self.run_dir, self.client.name, self.state)

    def _warn_once(self, text: str, *args: Any) -> None:
        with self._warning:
            if self._warned:
                return
            self._warned = True
        log.warning(text, *args)

    def _fail(self, err: Exception) -> None:
        self.failed = f"{type(err).__name__}: {err}"
        self._warn_once("tracker %s failed (%s); the training goes on without it, metrics.jsonl is the record (the "
                        "run's next launch sends it what it missed)", self.client.name,
                        self.failed.splitlines()[0][:500])
        try:
            self.client.close(False)
        except Exception:  # noqa: BLE001 - already failed; said once above
            pass


def _add(steps: dict[int, _Step], step: int, values: dict[str, float], when: float,
         image: tuple[str, np.ndarray] | None) -> None:
    item = steps.setdefault(step, _Step())
    item.values.update(values)
    item.times.update(dict.fromkeys(values, when))
    if image is not None:
        item.images.append(image)
