"""A resume's optimizer settings: the config wins for hyper-parameters, the checkpoint keeps the state
(train/resume_settings.py). The checkpoint's optimizer state goes through the same flattened DCP state dict a real
checkpoint holds (checkpoint/state_dicts.py), without a process group."""

import copy
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from torch import nn

from hpctrain.checkpoint.state_dicts import apply_tensor_state, tensor_state
from hpctrain.config import config_to_toml, load_config
from hpctrain.config.schema import OptimSection
from hpctrain.errors import UserError
from hpctrain.experiments.digits.experiment import DigitsExperiment, DigitsOptions
from hpctrain.train.optim import build_optimizer, build_scheduler, lr_factor
from hpctrain.train.resume_settings import (
    apply_hyperparameters, changed_lines, changed_since, hyperparameters, refuse_fixed_changes,
)

SAVED = OptimSection(lr=0.003, betas=(0.9, 0.999), weight_decay=0.01, warmup_steps=2, schedule="linear")


def _run(cfg: OptimSection, total: int, steps: int, seed: int = 0):
    """A model, optimizer and scheduler after ``steps`` steps of a run of ``total``."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 2))
    optimizer = build_optimizer(model, cfg)
    scheduler = build_scheduler(optimizer, cfg, total)
    for _ in range(steps):
        model(torch.randn(3, 4)).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
        scheduler.step()
    return model, optimizer, scheduler


def _resume(saved_run, cfg: OptimSection, total: int):
    """A fresh launch with ``cfg`` restored from ``saved_run``'s state, as train/run.py restores it."""
    model, optimizer, scheduler = saved_run
    tensors = copy.deepcopy(tensor_state({"model": model, "optimizer": optimizer}))
    schedule = copy.deepcopy(scheduler.state_dict())
    resumed = _run(cfg, total, steps=0, seed=1)
    built = hyperparameters(resumed[1])
    apply_tensor_state({"model": resumed[0], "optimizer": resumed[1]}, tensors)
    resumed[2].load_state_dict(schedule)
    apply_hyperparameters(resumed[1], resumed[2], built)
    return resumed


def test_an_unchanged_config_resumes_with_exactly_the_saved_rate_and_state():
    saved = _run(SAVED, total=10, steps=4)
    model, optimizer, scheduler = _resume(saved, SAVED, total=10)
    assert [g["lr"] for g in optimizer.param_groups] == [g["lr"] for g in saved[1].param_groups]
    assert scheduler.last_epoch == 4 and scheduler.get_last_lr() == saved[2].get_last_lr()
    for p, q in zip(model.parameters(), saved[0].parameters()):
        assert torch.equal(optimizer.state[p]["exp_avg"], saved[1].state[q]["exp_avg"])


def test_changed_hyperparameters_apply_from_the_resumed_step_and_the_state_is_kept():
    """optim.lr, betas, weight_decay and the schedule from the config; a longer run's schedule at the resumed step
    (not the old schedule's end, lr 0); the moments and step counts from the checkpoint."""
    saved = _run(SAVED, total=10, steps=10)
    assert saved[1].param_groups[0]["lr"] == 0.0  # the linear schedule's end: what a resume used to start at
    new = replace(SAVED, lr=0.1, betas=(0.8, 0.9), weight_decay=0.2, schedule="cosine", warmup_steps=12)
    model, optimizer, scheduler = _resume(saved, new, total=20)
    for group in optimizer.param_groups:
        assert group["lr"] == 0.1 * lr_factor(10, 20, new)  # still warming up: step 10 of 12
        assert group["initial_lr"] == 0.1 and group["betas"] == (0.8, 0.9)
        assert group["weight_decay"] in (0.2, 0.0)  # 1-D parameters never decay
    assert scheduler.base_lrs == [0.1] * len(optimizer.param_groups) and scheduler.last_epoch == 10
    for p, q in zip(model.parameters(), saved[0].parameters()):
        assert torch.equal(optimizer.state[p]["exp_avg_sq"], saved[1].state[q]["exp_avg_sq"])
        assert float(optimizer.state[p]["step"]) == 10
    optimizer.step()
    scheduler.step()  # the next step's rate: the new schedule, from where the checkpoint was
    assert optimizer.param_groups[0]["lr"] == pytest.approx(0.1 * lr_factor(11, 20, new))


def _config(*overrides: str):
    return load_config("digits", DigitsOptions, experiment_defaults=DigitsExperiment.defaults, overrides=overrides)


def test_a_changed_optimizer_is_refused_naming_the_key(tmp_path: Path):
    (tmp_path / "config.toml").write_text(config_to_toml(_config("optim.name=adamw")))
    refuse_fixed_changes(tmp_path, _config("optim.name=adamw", "optim.lr=0.5"))  # a hyper-parameter may change
    with pytest.raises(UserError, match="optim.name changed") as raised:
        refuse_fixed_changes(tmp_path, _config("optim.name=sgd"))
    assert "optim.name=adamw" in raised.value.hint


def test_the_log_says_each_changed_key_and_the_step(tmp_path: Path):
    before, after = config_to_toml(_config()), config_to_toml(_config("optim.lr=0.1", "optim.schedule=constant"))
    lines = changed_lines(before, after, step=10)
    assert "optim.lr: 0.003 -> 0.1 from step 10" in lines
    assert "optim.schedule: 'cosine' -> 'constant' from step 10" in lines and len(lines) == 2
    assert changed_since(tmp_path, after, step=10) == []  # no config.toml to compare with: nothing to say
    (tmp_path / "config.toml").write_text(before)
    assert changed_since(tmp_path, after, step=10) == lines


def test_the_open_log_window_is_part_of_the_train_state():
    """What a stop between two train records saves (train/loop.py open_window), read back; a checkpoint written
    before the fields existed resumes with an empty window."""
    from hpctrain.train.state import TrainState

    state = TrainState(step=15, log_loss=7.25, log_steps=5)
    assert TrainState.from_dict(state.to_dict()) == state
    old = {k: v for k, v in state.to_dict().items() if not k.startswith("log_")}
    assert TrainState.from_dict(old).log_steps == 0 and TrainState.from_dict(old).log_loss == 0.0


def _stateful(ema_decay: float, seed: int) -> dict:
    """A small training state, as train/context.py's stateful() gives the checkpointer."""
    from hpctrain.train.ema import build_ema

    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Linear(8, 2))
    cfg = replace(SAVED, ema_decay=ema_decay)
    optimizer = build_optimizer(model, cfg)
    return {"model": model, "optimizer": optimizer, "scheduler": build_scheduler(optimizer, cfg, 10),
            "scaler": torch.amp.GradScaler("cpu", enabled=False), "ema": build_ema(model, ema_decay)}


def _save_and_resume(tmp_path: Path, saved_decay: float, resumed_decay: float, caplog) -> dict:
    import logging

    from hpctrain.checkpoint.manager import Checkpointer
    from hpctrain.dist.runtime import single_process_runtime
    from hpctrain.train.rng import capture_rng
    from hpctrain.train.state import TrainState

    single = single_process_runtime(torch.device("cpu"))
    saved = _stateful(saved_decay, seed=0)
    state = TrainState(step=6, epoch=0, step_in_epoch=6, samples_seen=24)
    Checkpointer(tmp_path, "toy", single, "", 3).save(state.to_dict(), saved, capture_rng(single.device), wait=True)
    resumed = _stateful(resumed_decay, seed=1)
    caplog.set_level(logging.INFO, "hpctrain")
    Checkpointer(tmp_path, "toy", single, "", 3).restore("auto", resumed)
    for p, q in zip(resumed["model"].state_dict().values(), saved["model"].state_dict().values()):
        assert torch.equal(p, q)
    return resumed


def test_an_ema_turned_on_at_a_resume_starts_from_the_restored_weights(tmp_path: Path, caplog):
    """A checkpoint saved with optim.ema_decay=0, resumed with 0.9: the resume failed on every rank ('has no EMA
    weights') although the README says a changed ema_decay applies from the resumed step."""
    resumed = _save_and_resume(tmp_path, 0.0, 0.9, caplog)
    ema = resumed["ema"]
    for p, q in zip(ema.module.state_dict().values(), resumed["model"].state_dict().values()):
        assert torch.equal(p, q)
    assert int(ema.n_averaged) == 1  # its first update was that copy: the next one averages
    assert "holds no EMA weights (saved with optim.ema_decay=0): the EMA starts from the restored weights at step 6" \
        in caplog.text


def test_an_ema_turned_off_at_a_resume_says_its_weights_are_not_carried(tmp_path: Path, caplog):
    _save_and_resume(tmp_path, 0.9, 0.0, caplog)
    assert "holds EMA weights, but optim.ema_decay=0: they are not carried on" in caplog.text
    assert "resume with optim.ema_decay>0 to keep them" in caplog.text


def test_a_torn_config_toml_gives_no_lines_and_no_refusal(tmp_path: Path):
    """Not UTF-8 (a torn write): changed_since raised UnicodeDecodeError in the resume's log, after the restore, and
    the preflight's check raised it before launch; neither may stop a resume. Not TOML: the same."""
    from hpctrain.checkpoint.manager import changed_settings

    after = config_to_toml(_config("optim.lr=0.1"))
    for torn in (b"\xff\xfe[optim]\nlr = 0.\x80", b"[optim\nname = 'sgd'"):
        (tmp_path / "config.toml").write_bytes(torn)
        assert changed_since(tmp_path, after, step=10) == []
        refuse_fixed_changes(tmp_path, _config("optim.name=sgd"))
        assert changed_settings(tmp_path, after) == ""


def test_where_the_run_is_and_how_it_was_launched_are_not_changed_settings(tmp_path: Path):
    """A resume from another path (run.dir, ckpt.resume), a chunk's own train.stop_at_step and a job with more time
    say nothing about what the run trains: the log listed them beside optim.lr."""
    before = config_to_toml(_config("run.dir=/old/run", "train.stop_at_step=100", "slurm.time=01:00:00"))
    after = config_to_toml(_config("run.dir=/new/run", "ckpt.resume=/old/run/checkpoints/step_00000100",
                                   "train.stop_at_step=200", "slurm.time=04:00:00", "run.name=again",
                                   "log.progress=off", "alert.format=slack", "optim.lr=0.1", "run.seed=3"))
    assert changed_lines(before, after, step=100) == ["optim.lr: 0.003 -> 0.1 from step 100",
                                                      "run.seed: 0 -> 3 from step 100"]
