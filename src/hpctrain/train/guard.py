"""What watches a training and what a failing one does: the hang watchdog's start, the failure's alert and the
translation of torch errors that have a known cause in the config (train/run.py and the session of a user's loop
share them)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Callable

from hpctrain.config.schema import RunConfig
from hpctrain.dist.env import under_hpctrain_agent
from hpctrain.dist.runtime import Runtime
from hpctrain.errors import UserError, raised_on_every_rank
from hpctrain.fault.alerts import Alerter
from hpctrain.fault.heartbeat import Watchdog, format_stuck, slow_phase_limit
from hpctrain.logs import recent_log_lines
from hpctrain.train.context import FaultState


def failed(raised: BaseException, fault: FaultState, watchdog: Watchdog, alerter: Alerter, step: int,
           runtime: Runtime) -> BaseException:
    """A run failing with ``raised``: its signal handlers off (the launcher's SIGTERM should now end this process at
    once), the watchdog's last word, the alert; returns the error to raise (translate_error's)."""
    err = translate_error(raised)
    fault.signals.uninstall()
    watchdog.stop("failed")
    # Under hpctrain's torchrun wrapper the launcher reports the first failure once, for all ranks; without
    # it (srun tasks) an error every rank raised together, or bad input (the same on every rank as a rule), is
    # rank 0's to report, not 512 posts (where rank 0 did not raise it, it fails on the peer that left, and says so).
    if not under_hpctrain_agent() and not isinstance(err, KeyboardInterrupt) \
            and (runtime.is_main or not (raised_on_every_rank(err) or isinstance(err, UserError))):
        alerter.send("failure", last_step=step, exit_code=1, detail=f"{type(err).__name__}: {err}",
                     log_tail=recent_log_lines())
    return err


def start_watchdog(cfg: RunConfig, runtime: Runtime, fault: FaultState, alerter: Alerter,
                   step: Callable[[], int]) -> Watchdog:
    """This rank's watchdog over ``fault.heartbeat``, started; ``step()``: the run's step, for a hang's alert."""
    f = cfg.fault

    def on_hang(stale: list[dict]) -> None:
        alerter.send("hang", last_step=step(), detail="no progress:\n" + format_stuck(stale),
                     log_tail=recent_log_lines())

    watchdog = Watchdog(fault.heartbeat, Path(cfg.run_dir) / "heartbeat", f.heartbeat_every_s,
                        f.hang_timeout_s, runtime.is_main, on_hang,
                        slow_timeout_s=slow_phase_limit(f.slow_phase_timeout_s, cfg.dist.timeout_s, f.heartbeat_every_s),
                        # a save's waits are on the control plane: the peers fail only after dist.control_timeout_s
                        control_slow_timeout_s=slow_phase_limit(f.slow_phase_timeout_s, cfg.dist.control_timeout_s,
                                                                f.heartbeat_every_s))
    watchdog.beat()  # the file exists from the start (tests and operators find the pid there)
    watchdog.start()
    return watchdog


UNUSED_PARAMETERS = "Expected to have finished reduction in the prior iteration"


def translate_error(err: BaseException) -> BaseException:
    """Errors of torch's that have a known cause in the config, as a message with what to set. DDP's unused-parameter
    error is met first on a cluster (one process trains without DDP) and ends in advice about
    TORCH_DISTRIBUTED_DEBUG rather than the setting that fixes it."""
    text = str(err)
    if isinstance(err, RuntimeError) and UNUSED_PARAMETERS in text:
        ranks = re.search(r"Parameter indices which did not receive grad for rank (\d+): ([\d ]+)", text)
        which = f" (rank {ranks.group(1)}: parameter indices {ranks.group(2).strip()})" if ranks else ""
        return UserError(
            f"DDP: some trainable parameters got no gradient in this step{which}, so the gradient all-reduce "
            "cannot finish", "set dist.find_unused_parameters=true (DDP then looks for them every step, a little "
            "slower), or freeze the parameters the loss does not use (requires_grad=False).")
    return err
