import dataclasses
from pathlib import Path

import pytest

from hpctrain.config import config_to_toml, load_config
from hpctrain.config.schema import SECTIONS, RunConfig, field_docs
from hpctrain.config.validate import ConfigError
from hpctrain.errors import UserError
from hpctrain.experiments.digits import DigitsExperiment, DigitsOptions


def load(**kw):
    return load_config("digits", DigitsOptions, experiment_defaults=DigitsExperiment.defaults, **kw)


def test_precedence_defaults_experiment_file_cli(tmp_path: Path):
    assert load().train.global_batch_size == 100  # experiment default over hpctrain's 256
    f = tmp_path / "c.toml"
    f.write_text("[train]\nglobal_batch_size = 200\nmax_steps = 7\n[model]\nnorm = 'group'\n")
    cfg = load(config_file=f)
    assert (cfg.train.global_batch_size, cfg.train.max_steps, cfg.model.norm) == (200, 7, "group")
    cfg = load(config_file=f, overrides=["train.max_steps=9", "run.dir=/tmp/x y", "optim.betas=[0.9, 0.95]"])
    assert (cfg.train.global_batch_size, cfg.train.max_steps) == (200, 9)
    assert cfg.run.dir == "/tmp/x y" and cfg.optim.betas == (0.9, 0.95)


def test_cli_values_are_typed_by_the_schema():
    cfg = load(overrides=["data.augment=false", "optim.lr=1e-4", "run.name=123", "train.precision=bf16"])
    assert cfg.data.augment is False and cfg.optim.lr == 1e-4 and cfg.run.name == "123"
    assert load(overrides=["optim.lr=1"]).optim.lr == 1.0  # int accepted for a float


@pytest.mark.parametrize(
    "override, words",
    [
        ("train.max_step=5", ["unknown config key 'train.max_step'", "Did you mean 'train.max_steps'"]),
        ("trian.max_steps=5", ["unknown config section 'trian'", "Did you mean 'train'"]),
        ("train.max_steps=five", ["'train.max_steps' expects an integer", "five"]),
        ("data.augment=yes", ["'data.augment' expects true or false"]),
        ("train.precision=fp8", ["one of 'auto', 'fp32', 'bf16', 'fp16'"]),
        ("train.micro_batch_size=0", ["'train.micro_batch_size': must be positive"]),
        ("train.global_batch_size=90", ["90 is not a multiple of train.micro_batch_size=25"]),
        ("optim.lr=-1", ["'optim.lr': must be positive"]),
        ("ckpt.keep_last=0", ["'ckpt.keep_last'"]),
        ("model.widht=3", ["Did you mean 'model.width'"]),
        ("novalue", ["expected key=value"]),
    ],
)
def test_bad_values_name_the_key(override, words):
    with pytest.raises(UserError) as err:
        load(overrides=[override])
    for w in words:
        assert w in str(err.value)
    assert err.value.hint


def test_missing_config_file(tmp_path: Path):
    with pytest.raises(UserError, match="does not exist"):
        load(config_file=tmp_path / "missing.toml")


@pytest.mark.parametrize(
    "text, error",
    [
        ("[train\nx=1", "not valid TOML"),
        ("max_steps = 3\n", "must be a \\[section\\] table"),
        ('experiment = "cifar"\n[train]\nmax_steps = 3\n', "is for experiment 'cifar'"),
        ("[ckpt]\nevery_step = 3\n", "unknown config key 'ckpt.every_step' \\(from .*c.toml\\)"),
    ],
)
def test_bad_config_files(tmp_path: Path, text, error):
    path = tmp_path / "c.toml"
    path.write_text(text)
    with pytest.raises(UserError, match=error):
        load(config_file=path)


def test_resolved_config_round_trips_through_toml(tmp_path: Path):
    cfg = load(overrides=["train.max_steps=11", "model.norm=none", "optim.betas=[0.8, 0.9]"])
    path = tmp_path / "config.toml"
    path.write_text(config_to_toml(cfg))
    assert load_config("digits", DigitsOptions, config_file=path) == cfg


def test_configs_are_frozen():
    cfg = load()
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.train.max_steps = 3  # type: ignore[misc]


def test_every_field_has_a_docstring():
    for cls in [RunConfig, DigitsOptions, *SECTIONS.values()]:
        docs = field_docs(cls)
        missing = [f.name for f in dataclasses.fields(cls) if not docs.get(f.name)]
        assert not missing, f"{cls.__name__} fields without a docstring: {missing}"
