"""The commands hpctrain prints for the user to paste are shell-quoted (issue 38 item 11): with a run dir, config or
shard dir whose name holds a space or a quote, the pasted command gets the same path back as one argument."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from hpctrain.cli import main
from hpctrain.data.shardset import index_path
from hpctrain.errors import UserError
from tests.unit.test_slurm_submit_checks import slurm  # noqa: F401 (the stand-in sbatch and scontrol)

ODD = "my runs/it's here"


def test_a_config_for_another_experiment_names_a_pasteable_command(tmp_path, capsys):
    config = tmp_path / ODD / "ddpm run.toml"
    config.parent.mkdir(parents=True)
    config.write_text('experiment = "ddpm"\n')
    assert main(["train", "digits", "--config", str(config)]) == 2
    command = re.search(r"run (.*), or use a config", capsys.readouterr().err.replace("\n", " ")).group(1)
    assert shlex.split(command) == ["hpctrain", "train", "ddpm", "--config", str(config)]


def test_unindexed_shards_name_a_pasteable_command(tmp_path):
    split = tmp_path / ODD / "train"
    split.mkdir(parents=True)
    (split / "000000.tar").write_bytes(b"")
    with pytest.raises(UserError) as err:
        index_path(split)
    command = err.value.hint.split(": ", 1)[1]
    assert shlex.split(command) == ["hpctrain", "shard", "--index-only", str(split)]


def test_a_sweep_submit_prints_pasteable_follow_up_commands(tmp_path, slurm, capsys):  # noqa: F811
    sweep = tmp_path / ODD
    assert main(["sweep", "submit", "digits", "--grid", "optim.lr=0.1,0.2", "--dir", str(sweep), "train.max_steps=4",
                 "slurm.time=60", "ckpt.every_minutes=20"]) == 0
    lines = [line.strip() for line in capsys.readouterr().err.splitlines()]
    assert shlex.split(next(x for x in lines if "sweep status" in x)) == ["hpctrain", "sweep", "status", str(sweep)]
    assert shlex.split(next(x for x in lines if x.startswith("hpctrain report"))) == ["hpctrain", "report", str(sweep)]
