"""The end of a training that did not fail: stopped by a signal (its log line, alert, requeue and exit code) or
done (the plot, the last line, the completion alert). train/run.py's and the session's."""

from __future__ import annotations

import logging
import signal
import time
from dataclasses import dataclass
from pathlib import Path

from hpctrain.dist.collectives import barrier
from hpctrain.config.target import is_script
from hpctrain.dist.env import requeue_id, script_step
from hpctrain.fault.alerts import Alerter
from hpctrain.fault.heartbeat import Watchdog
from hpctrain.fault.requeue import requeue_slurm_job
from hpctrain.fault.signals import signal_name
from hpctrain.logs import recent_log_lines
from hpctrain.metrics.plots import plot_training
from hpctrain.metrics.records import read_metrics
from hpctrain.train import loop
from hpctrain.train.context import TrainContext

log = logging.getLogger("hpctrain")


@dataclass(frozen=True)
class Outcome:
    exit_code: int
    """0 when the run reached its end (or train.stop_at_step); fault.exit_code after a preemption checkpoint."""
    val: dict[str, float]
    """The last validation metrics."""


def conclude(ctx: TrainContext, result: loop.LoopResult, watchdog: Watchdog, alerter: Alerter,
             started: float) -> Outcome:
    """The end of a training that did not fail: stopped by a signal (requeue, exit code) or done (plots, alert)."""
    runtime = ctx.runtime
    if result.stop_signal:
        watchdog.stop("stopped")
        # torchrun SIGTERMs the other workers as soon as one exits; a rank still finishing its exit must not
        # die of it (exit -15 instead of fault.exit_code).
        ctx.fault.signals.ignore_from_now()
        return _stopped(ctx, alerter, result)
    watchdog.stop("done")
    ctx.fault.signals.uninstall()
    if runtime.is_main:
        _finish(ctx, result.val, time.perf_counter() - started, result.val_step)
        if ctx.state.step >= ctx.total_steps:
            alerter.send("complete", last_step=ctx.state.step, exit_code=0,
                         detail=", ".join(f"{k} {v:.4g}" for k, v in result.val.items() if "/" not in k))
    barrier(runtime)
    return Outcome(0, result.val)


INTERRUPTED = 130
"""The exit code of a run stopped by Ctrl-C (128 + SIGINT), with or without its checkpoint."""


def _stopped(ctx: TrainContext, alerter: Alerter, result: loop.LoopResult) -> Outcome:
    """A stop signal: the checkpoint is saved on every rank; say so, requeue, exit with fault.exit_code. Ctrl-C
    (SIGINT) is the user's, not the cluster's: no requeue and no alert, exit code 130."""
    rt, f = ctx.runtime, ctx.cfg.fault
    if result.stop_signal == signal.SIGINT:
        if rt.is_main:
            log.warning("interrupted (Ctrl-C) at step %d with a checkpoint; the same command resumes from it",
                        ctx.state.step)
        barrier(rt)
        return Outcome(INTERRUPTED, result.val)
    if rt.is_main:
        got = ctx.fault.signals.received_at
        after = f", {time.monotonic() - got:.1f} s after the signal reached rank 0" if got else ""
        log.warning(
            "stopped by %s at step %d with a checkpoint%s; exit code %d means: resume me (same run dir)",
            signal_name(result.stop_signal), ctx.state.step, after, f.exit_code,
        )
        alerter.send("requeue", last_step=ctx.state.step, exit_code=f.exit_code,
                     detail=f"stopped by {signal_name(result.stop_signal)}", log_tail=recent_log_lines())
    barrier(rt)  # every rank is past its save before the job can be requeued (which kills it)
    # A script job hpctrain rendered is requeued by its batch shell, on its exit code (the launchers record the ranks'
    # exits there); everything else requeues itself here.
    if rt.is_main and f.requeue and rt.job_id and not (is_script(ctx.cfg.experiment) and script_step().exits_dir):
        requeue_slurm_job(requeue_id())  # a sweep's array task: its own ARRAY_TASK id, never the array's
    return Outcome(f.exit_code, result.val)


def _finish(ctx: TrainContext, final: dict[str, float], seconds: float, val_step: int = 0) -> None:
    run_dir = Path(ctx.cfg.run_dir)
    if ctx.cfg.log.plots and (run_dir / "metrics.jsonl").exists():
        path = plot_training(read_metrics(run_dir / "metrics.jsonl"), run_dir / "plots" / "training.png", ctx.cfg.run_name)
        log.info("plot: %s", path)
    log.info("done: step %d in %.1f s%s; run dir %s", ctx.state.step, seconds, done_val(final, val_step, ctx.state.step),
             run_dir)


def done_val(final: dict[str, float], val_step: int, step: int) -> str:
    """'; val loss 0.0076, accuracy 1.0000' for a validation at the last step; with its step when it was earlier
    (train.stop_at_step between two validations): '; val at step 14: ...'."""
    shown = ", ".join(f"{k} {v:.4f}" for k, v in final.items() if "/" not in k)  # details: in the table above
    if not shown:
        return ""
    return f"; val {shown}" if val_step in (0, step) else f"; val at step {val_step}: {shown}"
