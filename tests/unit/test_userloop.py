"""The session API of a loop you write (hpctrain.userloop), in this process on one rank: bad use is a message that
says what to do, never a hang or a traceback from deep inside; and the pieces that are pure functions."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

from hpctrain.config.load import config_to_toml, given_keys, load_config, settings_toml
from hpctrain.config.schema import NoModelOptions, RunConfig
from hpctrain.dist.runtime import single_process_runtime
from hpctrain.errors import UserError
from hpctrain.experiments.base import sums_over_count
from hpctrain.userloop import resolve_session_config
from hpctrain.userloop.core import TrainingSession


def _session(tmp_path: Path, *overrides: str) -> TrainingSession:
    cfg = load_config("script:loop.py", NoModelOptions, overrides=(
        f"run.dir={tmp_path / 'run'}", "train.global_batch_size=4", "train.micro_batch_size=2", "train.max_steps=2",
        "log.progress=off", "log.tensorboard=false", "log.plots=false", "data.num_workers=0", *overrides))
    return TrainingSession(cfg, single_process_runtime(torch.device("cpu")), config_to_toml(cfg))


def _data() -> TensorDataset:
    return TensorDataset(torch.randn(16, 3), torch.randn(16, 1))


def _misuse(tmp_path: Path, body, *words: str) -> None:
    run = _session(tmp_path)
    with pytest.raises(UserError) as raised:
        with run.opened():
            body(run)
    text = str(raised.value)
    assert all(w in text for w in words), text
    assert "HINT:" in text  # says what to do


def _one_model(run) -> nn.Module:
    model = run.wrap(nn.Linear(3, 1))
    run.register(model=model, opt=torch.optim.SGD(model.parameters(), lr=0.1))
    return model


def test_registering_something_without_state_is_refused(tmp_path: Path):
    _misuse(tmp_path, lambda run: run.register(counter=object()), "'counter'", "no state_dict")


def test_wrapping_a_model_twice_is_refused(tmp_path: Path):
    def body(run):
        model = nn.Linear(3, 1)
        run.wrap(model)
        run.wrap(model)

    _misuse(tmp_path, body, "wrapped already")


def test_a_model_not_made_by_wrap_is_refused_and_one_wrapped_must_be_registered(tmp_path: Path):
    _misuse(tmp_path, lambda run: run.register(m=nn.Linear(3, 1)), "'m'", "not made by run.wrap")

    def unregistered(run):
        run.wrap(nn.Linear(3, 1))
        for _ in run.steps(_data()):
            pass

    _misuse(tmp_path / "b", unregistered, "wrapped by run.wrap but not registered")


def test_calling_steps_twice_is_refused(tmp_path: Path):
    def body(run):
        run.register(m=run.wrap(nn.Linear(3, 1)))
        run.steps(_data())
        run.steps(_data())

    _misuse(tmp_path, body, "run.steps called twice")


def test_an_optimizer_built_before_wrapping_or_over_another_model_is_refused(tmp_path: Path):
    def body(run):
        model = run.wrap(nn.Linear(3, 1))
        stray = torch.optim.SGD(nn.Linear(3, 1).parameters(), lr=0.1)
        run.register(model=model, opt=stray)
        for _ in run.steps(_data()):
            pass

    _misuse(tmp_path, body, "optimizer 'opt'", "no registered model")


def test_the_run_outside_its_session_is_refused(tmp_path: Path):
    run = _session(tmp_path)
    with run.opened():
        pass
    with pytest.raises(UserError, match="outside its session"):
        run.wrap(nn.Linear(3, 1))


def test_steps_misused_inside_the_loop(tmp_path: Path):
    def unknown_name(run):
        _one_model(run)
        for step in run.steps(_data()):
            for _ in step.micro_batches("adam"):
                pass

    _misuse(tmp_path, unknown_name, "'adam'", "no optimizer of that name", "['opt']")

    kept = []

    def twice_and_late(run):
        model = _one_model(run)
        for step in run.steps(_data()):
            for (x, y), _ in step.micro_batches():
                step.backward(nn.functional.mse_loss(model(x), y))
            step.optimizer_step()
            kept.append(step)
            step.optimizer_step()

    _misuse(tmp_path / "b", twice_and_late, "optimizer_step('opt') twice in one step")
    with pytest.raises(UserError, match="after the step ended"):
        kept[0].close()
        kept[0].log(loss=1.0)


def test_a_short_loop_trains_saves_and_its_records_hold_named_values(tmp_path: Path):
    """The happy path in one process: two steps, a record per step with the logged (sum, count) and mean values,
    one checkpoint holding the model and optimizer by name."""
    run = _session(tmp_path, "log.every_steps=1")
    with run.opened():
        model = run.wrap(nn.Linear(3, 1))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        run.register(model=model, opt=opt)
        for step in run.steps(_data()):
            for (x, y), info in step.micro_batches():
                loss = nn.functional.mse_loss(model(x), y, reduction="sum")
                step.backward((loss, len(x)))
                step.log(mse=(loss.detach(), len(x)), constant=2.0)
            step.optimizer_step()
    assert run.exit_code == 0
    from tests.conftest import checkpoint_tensors, latest_checkpoint, read_jsonl

    train = [r for r in read_jsonl(tmp_path / "run" / "metrics.jsonl") if r["split"] == "train"]
    assert [r["step"] for r in train] == [1, 2] and all(r["constant"] == 2.0 and r["mse"] > 0 for r in train)
    assert "loss" not in train[0] and "lr" in train[0]
    assert set(checkpoint_tensors(latest_checkpoint(tmp_path / "run"))) == {"model.weight", "model.bias"}


def test_the_session_settings_rank_the_command_line_above_the_scripts_own(tmp_path: Path, monkeypatch):
    settings = tmp_path / "settings.toml"
    given = ["train.max_steps=7", "run.dir=/tmp/x y"]
    settings.write_text(settings_toml(load_config("script:train.py", NoModelOptions, overrides=given),
                                      given_keys("script:train.py", None, given)))
    monkeypatch.setenv("HPCTRAIN_SETTINGS", str(settings))
    cfg = resolve_session_config({"train.max_steps": 3, "train.epochs": 5}, overrides=["train.epochs=6"])
    assert (cfg.train.max_steps, cfg.train.epochs, cfg.run.dir, cfg.experiment) == (7, 6, "/tmp/x y",
                                                                                    "script:train.py")
    monkeypatch.delenv("HPCTRAIN_SETTINGS")
    cfg = resolve_session_config({"train.max_steps": 3}, name="mine.py")
    assert cfg.train.max_steps == 3 and cfg.run_dir == "runs/mine"
    settings.write_text('experiment = "script:train.py"\n[train]\nmax_step = 7\n')
    with pytest.raises(UserError, match="unknown config key 'train.max_step'.*Did you mean 'train.max_steps'"):
        load_config("script:train.py", NoModelOptions, launch_settings=settings)


def test_metrics_from_sums_divide_each_sum_by_the_count():
    assert sums_over_count({"loss_sum": 6.0, "correct_sum": 3.0, "count": 4.0, "hist": 2.0}) == \
        {"loss": 1.5, "correct": 0.75, "hist": 2.0}
    assert sums_over_count({"count": 4.0}) == {"count": 4.0}


def test_a_script_run_dir_is_named_after_the_script():
    assert RunConfig(experiment="script:jobs/vocoder.py").run_dir == "runs/vocoder"


def _two_models(run):
    g, d = run.wrap(nn.Linear(3, 3)), run.wrap(nn.Linear(3, 1))
    run.register(g=g, d=d, opt_g=torch.optim.SGD(g.parameters(), lr=0.1), opt_d=torch.optim.SGD(d.parameters(), lr=0.1))
    return g, d


def test_gradients_only_optimizer_step_can_finish_need_it(tmp_path: Path):
    """A (sum, count) loss awaits the global count, an fp16 loss is scaled: a plain opt.step() would step on wrong
    gradients, so the step ends with a message; so does a step before the pass's last (syncing) micro-batch."""
    def own_step_after_token_loss(run):
        model = run.wrap(nn.Linear(3, 1))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        run.register(model=model, opt=opt)
        for step in run.steps(_data()):
            for (x, y), _ in step.micro_batches():
                step.backward((nn.functional.mse_loss(model(x), y, reduction="sum"), len(x)))
            opt.step()

    _misuse(tmp_path, own_step_after_token_loss, "optimizer 'opt' got a (sum, count) loss in step 0",
            "step.optimizer_step('opt')")

    def early(run):
        model = _one_model(run)
        for step in run.steps(_data()):
            for (x, y), _ in step.micro_batches():
                step.backward(nn.functional.mse_loss(model(x), y))
                step.optimizer_step()

    _misuse(tmp_path / "b", early, "step.optimizer_step('opt') before the pass over step.micro_batches ran its last "
            "micro-batch's backward (of 2", "run.poll()")

    def second_pass_early(run):
        g, d = _two_models(run)
        for step in run.steps(_data()):
            for (x, y), _ in step.micro_batches("opt_d"):
                step.backward(nn.functional.mse_loss(d(x), y))
            step.optimizer_step("opt_d")
            for (x, y), _ in step.micro_batches("opt_g"):
                step.backward(-d(g(x)).mean())
                step.optimizer_step("opt_g")

    _misuse(tmp_path / "c", second_pass_early, "step.optimizer_step('opt_g') before the pass")

    def first_pass_left(run):  # a pass left early stays left, whatever later passes do
        g, d = _two_models(run)
        for step in run.steps(_data()):
            for (x, y), _ in step.micro_batches("opt_d"):
                step.backward(nn.functional.mse_loss(d(x), y))
                break
            for (x, y), _ in step.micro_batches("opt_g"):
                step.backward(-d(g(x)).mean())
            step.optimizer_step("opt_g")

    _misuse(tmp_path / "c2", first_pass_left, "step.optimizer_step('opt_g') before step.micro_batches('opt_d') ran")

    def before_last_backward(run):  # in the last micro-batch, but before its (syncing) backward
        model = _one_model(run)
        for step in run.steps(_data()):
            for micro, ((x, y), _) in enumerate(step.micro_batches()):
                loss = nn.functional.mse_loss(model(x), y)
                if micro == 1:
                    step.optimizer_step()
                step.backward(loss)

    _misuse(tmp_path / "c3", before_last_backward, "step.optimizer_step('opt') before the pass")

    def left(run):
        model = _one_model(run)
        for step in run.steps(_data()):
            for (x, y), _ in step.micro_batches():
                step.backward(nn.functional.mse_loss(model(x), y))
                break

    _misuse(tmp_path / "d", left, "the end of the step before step.micro_batches() ran its last")

    run = _session(tmp_path / "e")  # stepping within the last micro-batch is stepping after the whole pass
    with run.opened():
        model = _one_model(run)
        for step in run.steps(_data()):
            for micro, ((x, y), _) in enumerate(step.micro_batches()):
                step.backward(nn.functional.mse_loss(model(x), y))
                if micro == 1:
                    step.optimizer_step()
    assert run.exit_code == 0


def test_a_token_optimizers_count_scales_only_the_steps_that_gave_one(tmp_path: Path):
    """Once an optimizer took a (sum, count), every rank all-reduces its count at each of its steps (a collective
    cannot depend on a rank's data); a later step of mean losses is left as it is (factor world / world)."""
    run = _session(tmp_path)
    counts = []
    with run.opened():
        model = _one_model(run)
        for step in run.steps(_data()):
            for (x, y), _ in step.micro_batches():
                loss = nn.functional.mse_loss(model(x), y, reduction="sum")
                step.backward((loss, len(x)) if step.index == 0 else loss / len(x))
            counts.append(float(step._global_count("opt")))
            step.optimizer_step()
    assert counts == [4.0, float(run.world_size)]
    assert run.ratio_optimizers == {"opt"}


def test_the_data_of_run_steps_cannot_be_registered(tmp_path: Path):
    class Loader(list):
        def state_dict(self):
            return {}

        def load_state_dict(self, state):
            pass

    def body(run):
        model = run.wrap(nn.Linear(3, 1))
        data = Loader([(torch.randn(2, 3), torch.randn(2, 1))] * 4)
        steps = run.steps(data)  # registered after run.steps, as a schedule over steps.total is
        run.register(model=model, opt=torch.optim.SGD(model.parameters(), lr=0.1), data=data)
        for _ in steps:
            pass

    _misuse(tmp_path, body, "run.steps over the object registered as 'data'", "do not register")


def test_fp16_losses_go_through_their_own_optimizers_pass(tmp_path: Path):
    """With a loss scaler per optimizer, a loss for 'opt_g' outside its pass would reach d's gradients scaled by
    g's scaler (and be unscaled by d's). GradScaler runs on the CPU, so fp16's scaling is exercised here."""
    from hpctrain.train.precision import Precision

    def outside(run):
        run.precision = Precision("fp16", None, "cpu")
        g, d = _two_models(run)
        for step in run.steps(_data()):
            for (x, y), _ in step.micro_batches():
                step.backward(nn.functional.mse_loss(d(g(x)), y), "opt_g")

    _misuse(tmp_path, outside, "fp16 for optimizer 'opt_g' in a pass for every optimizer", "micro_batches('opt_g')")

    def unnamed(run):
        run.precision = Precision("fp16", None, "cpu")
        g, d = _two_models(run)
        for step in run.steps(_data()):
            for (x, y), _ in step.micro_batches():
                step.backward(nn.functional.mse_loss(d(g(x)), y))

    _misuse(tmp_path / "b", unnamed, "several optimizers and no pass named")

    def split(run):
        run.precision = Precision("fp16", None, "cpu")
        model = run.wrap(nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 1)))
        run.register(model=model, first=torch.optim.SGD(model[0].parameters(), lr=0.1),
                     second=torch.optim.SGD(model[1].parameters(), lr=0.1))
        for step in run.steps(_data()):
            for (x, y), _ in step.micro_batches("first"):
                step.backward(nn.functional.mse_loss(model(x), y))

    _misuse(tmp_path / "d", split, "models ['model'] are stepped by optimizer 'first' and another", "bf16")

    run = _session(tmp_path / "c")  # each pass through its own scaler: trains, scalers checkpointed by name
    run.precision = Precision("fp16", None, "cpu")
    with run.opened():
        g, d = _two_models(run)
        for step in run.steps(_data()):
            for name, loss_of in (("opt_d", lambda x, y: nn.functional.mse_loss(d(g(x).detach()), y)),
                                  ("opt_g", lambda x, y: -d(g(x)).mean())):
                for (x, y), _ in step.micro_batches(name):
                    step.backward(loss_of(x, y))
                step.optimizer_step(name)
    assert run.exit_code == 0 and all(s.is_enabled() for s in run.objects.scalers.values())
    assert all(p.grad is None or not p.grad.abs().sum() for p in [*g.parameters(), *d.parameters()])  # zeroed


def test_evaluate_puts_back_each_models_own_mode(tmp_path: Path):
    """A frozen teacher in eval stays in eval after validation while the student goes back to training; a
    record made inside a step is numbered as that step's train record (the steps done)."""
    run = _session(tmp_path)
    with run.opened():
        student = run.wrap(nn.Sequential(nn.Linear(3, 1), nn.Dropout(0.1)))
        teacher = run.wrap(nn.Linear(3, 1).requires_grad_(False).eval())
        run.register(student=student, teacher=teacher, opt=torch.optim.SGD(student.parameters(), lr=0.1))
        student.train()
        for step in run.steps(_data()):
            for (x, y), _ in step.micro_batches():
                step.backward(nn.functional.mse_loss(student(x) + teacher(x), y))
            step.optimizer_step()
            got = run.evaluate(lambda b: {"loss_sum": nn.functional.mse_loss(student(b[0]), b[1], reduction="sum"),
                                          "count": len(b[0])}, _data())
            assert got["loss"] > 0
            assert student.training and all(m.training for m in student.modules())
            assert not teacher.training
    from tests.conftest import read_jsonl

    val = [r["step"] for r in read_jsonl(tmp_path / "run" / "metrics.jsonl") if r["split"] == "val"]
    assert val == [1, 2]
