"""Checks of a RunConfig that need no processes: each refusal names its key and what to do.

RunConfig.__post_init__ (schema.py) calls validate(), so this module imports nothing of schema.py, not even for
types: the checks read the sections by attribute.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

from hpctrain.config.batch import micro_batch_hint
from hpctrain.errors import UserError
from hpctrain.units import time_limit_seconds


class ConfigError(UserError, ValueError):
    """A config value that cannot work; the message names the key."""


def _require(ok: bool, key: str, message: str, hint: str = "") -> None:
    if not ok:
        hint = hint or f"set {key}=VALUE on the command line or in the TOML file; 'hpctrain config EXPERIMENT --describe' explains every key."
        raise ConfigError(f"config key '{key}': {message}", hint)


ALERT_WEBHOOK = "HPCTRAIN_ALERT_WEBHOOK"
"""The environment variable that holds the alert webhook's URL (a credential: never in a config, see slurm.env)."""

ALERT_EVENTS = frozenset({"failure", "requeue", "hang", "complete"})


def validate(cfg: Any) -> None:
    """Checks of single values and of pairs within a section, of ``cfg``: a RunConfig."""
    t, o = cfg.train, cfg.optim
    _require(t.global_batch_size > 0, "train.global_batch_size", f"must be positive, got {t.global_batch_size}")
    _require(t.micro_batch_size > 0, "train.micro_batch_size", f"must be positive, got {t.micro_batch_size}")
    _require(
        t.global_batch_size % t.micro_batch_size == 0,
        "train.global_batch_size",
        f"{t.global_batch_size} is not a multiple of train.micro_batch_size={t.micro_batch_size}",
        f"{micro_batch_hint(t.global_batch_size)} (for N processes: those that divide {t.global_batch_size}/N); or "
        f"make train.global_batch_size a multiple of {t.micro_batch_size}.",
    )
    _require(t.max_steps >= 0, "train.max_steps", "must be >= 0 (0 means: use train.epochs)")
    _require(t.epochs > 0 or t.max_steps > 0, "train.epochs", "must be positive when train.max_steps is 0")
    _require(t.stop_at_step >= 0, "train.stop_at_step", "must be >= 0 (0: run to the end)")
    _require(t.grad_clip >= 0, "train.grad_clip", "must be >= 0 (0 disables clipping)")
    _require(t.max_skipped_steps >= 0, "train.max_skipped_steps",
             f"must be >= 0 (0: stop at the first step skipped for a non-finite gradient), got {t.max_skipped_steps}")
    _require(o.lr > 0, "optim.lr", f"must be positive, got {o.lr}")
    _require(o.weight_decay >= 0, "optim.weight_decay", "must be >= 0")
    _require(all(0 <= b < 1 for b in o.betas), "optim.betas", f"each beta must be in [0, 1), got {list(o.betas)}")
    _require(o.warmup_steps >= 0, "optim.warmup_steps", "must be >= 0")
    _require(0 <= o.min_lr_ratio <= 1, "optim.min_lr_ratio", "must be in [0, 1]")
    _require(o.poly_power > 0, "optim.poly_power", f"must be positive (DeepLab uses 0.9), got {o.poly_power}")
    _require(0 <= o.ema_decay < 1, "optim.ema_decay", "must be in [0, 1); 0 disables EMA")
    _require(cfg.data.num_workers >= -1, "data.num_workers", "must be >= 0, or -1 for automatic")
    _require(cfg.data.prefetch_factor > 0, "data.prefetch_factor", "must be positive")
    _require(cfg.data.shuffle_window >= 1, "data.shuffle_window", "must be at least 1 (1: no shuffling within the stream)")
    _require(cfg.data.read_block_kb >= 4, "data.read_block_kb", "must be at least 4")
    _require(cfg.data.read_cache_mb * 1024 >= 2 * cfg.data.read_block_kb, "data.read_cache_mb",
             "must hold at least two read blocks (data.read_block_kb)")
    _require(cfg.eval.every_steps >= 0, "eval.every_steps", "must be >= 0")
    _require(cfg.eval.micro_batch_size >= 0, "eval.micro_batch_size", "must be >= 0")
    _require(cfg.log.every_steps > 0, "log.every_steps", "must be positive")
    _require(cfg.log.outputs_every_steps >= 0, "log.outputs_every_steps", "must be >= 0 (0: not by steps)")
    _require(cfg.log.outputs_every_epochs >= 0, "log.outputs_every_epochs", "must be >= 0 (0: not by epochs)")
    _validate_trackers(cfg.log)
    _require(cfg.ckpt.every_steps >= 0, "ckpt.every_steps", "must be >= 0 (0: only at the end)")
    _require(cfg.ckpt.keep_last >= 1, "ckpt.keep_last", "must be >= 1: the latest checkpoint is always kept")
    _require(cfg.dist.timeout_s > 0, "dist.timeout_s", "must be positive")
    _require(cfg.dist.control_timeout_s >= cfg.dist.timeout_s, "dist.control_timeout_s",
             f"must be at least dist.timeout_s ({cfg.dist.timeout_s}): the control plane waits for slow work, "
             "the training collectives must not wait longer")
    _require(cfg.ckpt.every_minutes >= 0, "ckpt.every_minutes", "must be >= 0 (0 disables time-based saves)")
    f = cfg.fault
    _require(0 < f.exit_code < 256, "fault.exit_code", "must be in 1..255")
    _require(f.heartbeat_every_s > 0, "fault.heartbeat_every_s", "must be positive")
    _require(f.hang_timeout_s >= 0, "fault.hang_timeout_s", "must be >= 0 (0 disables hang detection)")
    _require(
        f.hang_timeout_s == 0 or f.hang_timeout_s > f.heartbeat_every_s,
        "fault.hang_timeout_s", "must be longer than fault.heartbeat_every_s, or the watchdog cannot see progress",
    )
    _require(f.slow_phase_timeout_s >= 0, "fault.slow_phase_timeout_s", "must be >= 0")
    _require(all(0 < c < 256 for c in f.requeue_exit_codes), "fault.requeue_exit_codes",
             f"each code must be in 1..255, got {list(f.requeue_exit_codes)}")
    bad = sorted(set(cfg.alert.events) - ALERT_EVENTS)
    _require(not bad, "alert.events", f"unknown event(s) {bad}; choose from {sorted(ALERT_EVENTS)}")
    _require(cfg.alert.timeout_s > 0, "alert.timeout_s", "must be positive")
    _require(cfg.dist.bucket_cap_mb > 0, "dist.bucket_cap_mb", "must be positive")
    _require(not (cfg.train.step_mode == "graphed" and cfg.train.precision == "fp16"), "train.step_mode",
             "'graphed' does not take train.precision=fp16: GradScaler updates its loss scale on the host between "
             "steps", "use train.precision=bf16 (GPUs from Ampere on), or train.step_mode=auto or eager with fp16.")
    _require(not (cfg.train.compile and cfg.train.step_mode == "eager"), "train.step_mode",
             "'eager' contradicts train.compile=true (which compiles the model)",
             "drop one: train.step_mode=compiled alone compiles, train.step_mode=eager alone does not.")
    if cfg.dist.strategy == "fsdp":
        _require(cfg.dist.grad_compression == "none", "dist.grad_compression",
                 f"'{cfg.dist.grad_compression}' is a DDP communication hook and does not apply to dist.strategy=fsdp",
                 "set dist.grad_compression=none; under fsdp gradients are reduced in fp32 and parameters gathered in "
                 "bf16 on GPUs with bf16 (train.precision).")
        _require(cfg.train.sync_batchnorm != "on", "train.sync_batchnorm",
                 "'on' is not supported with dist.strategy=fsdp (batch norm statistics stay per rank under fsdp)",
                 "set train.sync_batchnorm=auto or off, or use dist.strategy=ddp or zero1.")
        _require(cfg.train.step_mode != "compiled", "train.step_mode",
                 "'compiled' is not supported with dist.strategy=fsdp yet (the same inductor failure as train.compile)",
                 "set train.step_mode=auto or eager with fsdp.")
        _require(not cfg.train.compile, "train.compile",
                 "is not supported with dist.strategy=fsdp yet: compiling the whole FSDP2 model fails in torch 2.14's "
                 "inductor (measured: 'Cannot convert expression to float' in the recompile for the validation batch)",
                 "set train.compile=false with fsdp, or use dist.strategy=zero1 (sharded optimizer state) with compile.")
    _validate_slurm(cfg.slurm)


TRACKERS = ("wandb", "mlflow", "tensorboard")


def _validate_trackers(log: Any) -> None:
    """log.trackers and their settings (whether the packages are installed is the launch's check: a config is also
    read where they need not be, on a login node rendering a job)."""
    bad = [t for t in log.trackers if t not in TRACKERS]
    _require(not bad, "log.trackers", f"unknown tracker(s) {bad}; choose from {list(TRACKERS)}")
    _require(len(set(log.trackers)) == len(log.trackers), "log.trackers", f"a tracker is named twice: {list(log.trackers)}")
    _require(log.tracker_timeout_s > 0, "log.tracker_timeout_s", f"must be positive, got {log.tracker_timeout_s}")
    _require(all(t.strip() for t in log.tracker_tags), "log.tracker_tags", "an empty tag")


_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


def _validate_slurm(s: Any) -> None:
    """The [slurm] section (a SlurmSection)."""
    _require(s.nodes > 0, "slurm.nodes", f"must be positive, got {s.nodes}")
    _require(s.gpus_per_node > 0, "slurm.gpus_per_node", f"must be positive (processes per node), got {s.gpus_per_node}")
    _require(s.cpus_per_task >= 0, "slurm.cpus_per_task", "must be >= 0 (0: 8 per process)")
    _require(s.signal_lead_s >= 0, "slurm.signal_lead_s", "must be >= 0 (0: no warning signal)")
    _require(s.monitor_every_s >= 0, "slurm.monitor_every_s", "must be >= 0 (0 disables the monitors)")
    _require(s.port == 0 or 1024 <= s.port <= 65535, "slurm.port", "must be 0 (from the job id) or in 1024..65535")
    try:
        time_limit_seconds(s.time)
    except ValueError:
        _require(False, "slurm.time", f"{s.time!r} is not a Slurm time limit",
                 "use [D-]HH:MM:SS, MM, or D-HH, e.g. slurm.time=\"1-00:00:00\" for one day")
    for f in dataclasses.fields(s):
        # A newline would end an #SBATCH line and start a shell command: no control characters anywhere.
        values = getattr(s, f.name)
        for v in values if isinstance(values, tuple) else (values,):
            _require(not (isinstance(v, str) and any(ord(c) < 32 or ord(c) == 127 for c in v)),
                     f"slurm.{f.name}", "must not contain newlines or other control characters")
    _require("/" not in s.job_name, "slurm.job_name", "must not contain '/' (it names the log file, %x_%j.out)")
    for key in ("env", "extra_sbatch"):
        # A secret here would be written to config.toml, every checkpoint and the job script
        # (e.g. env 'export HPCTRAIN_ALERT_WEBHOOK=...' or extra_sbatch '--export=ALL,HPCTRAIN_ALERT_WEBHOOK=...').
        _require(not any(ALERT_WEBHOOK in item for item in getattr(s, key)), f"slurm.{key}",
                 f"must not hold {ALERT_WEBHOOK}: the webhook URL is a credential, and slurm.{key} is written "
                 "into config.toml, every checkpoint and the job script",
                 f"remove it from slurm.{key} and put the URL alone into a file only you can read (chmod 600), named "
                 "by alert.webhook_file; exporting it in the submitting shell is not enough where sbatch does not "
                 "pass the environment on (--export)")
    # Errors below show an item only up to its '=': values may be credentials of other services.
    for item in s.env:
        name, eq, _ = item.partition("=")
        _require(bool(eq) and bool(_ENV_NAME.match(name)), "slurm.env",
                 f"{_up_to_value(item)!r} is not NAME=value (NAME: letters, digits, underscore)")
    for item in s.extra_sbatch:
        _require(item.startswith("-"), "slurm.extra_sbatch",
                 f"{_up_to_value(item)!r} is not an sbatch option; write e.g. '--mail-type=END' (without '#SBATCH')")


def _up_to_value(item: str) -> str:
    name, eq, value = item.partition("=")
    return f"{name}=..." if eq and value else item
