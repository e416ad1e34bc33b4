"""`hpctrain config EXP --describe`: each list key shows an example of its own kind, one that the key accepts."""

import dataclasses
import re
import typing

import pytest

from hpctrain.config import load_config
from hpctrain.config.describe import describe_keys
from hpctrain.config.examples import LIST_EXAMPLES
from hpctrain.config.load import section_classes
from hpctrain.config.schema import NoModelOptions
from hpctrain.errors import UserError
from hpctrain.experiments import resolve_experiment

EXPERIMENTS = ("digits", "ddpm_digits", "faceseg")


def described_examples(name: str) -> dict[str, str]:
    cls = resolve_experiment(name)
    text = describe_keys(load_config(name, cls.config_class, experiment_defaults=cls.defaults))
    return dict(re.findall(r"^  (\S+) = .*\(a list (?:of \d values )?such as (\[.*\])\)$", text, re.M))


def list_keys(model_class: type) -> list[str]:
    return [f"{section}.{f.name}" for section, cls in section_classes(model_class).items()
            for f in dataclasses.fields(cls) if typing.get_origin(typing.get_type_hints(cls)[f.name]) is tuple]


def test_the_slurm_list_keys_each_get_an_example_of_their_own():
    examples = described_examples("digits")
    keys = ["slurm.modules", "slurm.setup", "slurm.env", "slurm.extra_sbatch", "slurm.container_binds"]
    shown = [examples[k] for k in keys]
    assert len(set(shown)) == len(keys) and '["failure", "hang"]' not in shown, shown
    assert "CUDA" in examples["slurm.modules"] and re.search(r'"[A-Z_]+=', examples["slurm.env"])


@pytest.mark.parametrize("name", EXPERIMENTS)
def test_every_list_example_is_a_value_its_key_accepts(name):
    examples = described_examples(name)
    cls = resolve_experiment(name)
    assert set(examples) == set(list_keys(cls.config_class))  # every list key shows one, nothing else does
    for key, example in examples.items():
        load_config(name, cls.config_class, experiment_defaults=cls.defaults, overrides=[f"{key}={example}"])


def test_each_list_key_of_hpctrains_own_sections_has_a_chosen_example():
    """A new list key needs its example here, not a generic one."""
    assert set(list_keys(NoModelOptions)) == set(LIST_EXAMPLES)


def test_a_wrong_list_value_is_told_with_the_keys_own_example():
    cls = resolve_experiment("digits")
    with pytest.raises(UserError, match=re.escape('expects a list such as ["CUDA/12.4", "NCCL"], got 5')):
        load_config("digits", cls.config_class, experiment_defaults=cls.defaults, overrides=["slurm.modules=5"])


def test_lists_are_shown_on_one_line():
    cls = resolve_experiment("digits")
    text = describe_keys(load_config("digits", cls.config_class, experiment_defaults=cls.defaults))
    assert '  alert.events = ["failure", "requeue", "hang"]  (' in text
