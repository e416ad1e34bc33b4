"""Bad input through the real entry point: one-paragraph message, exit 2, no traceback, nothing lost."""

import re
from pathlib import Path

import pytest

from hpctrain.cli import main


def run(capsys, *argv):
    code = main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


@pytest.mark.parametrize(
    "argv, words",
    [
        (["train", "digts"], ["unknown experiment 'digts'", "Did you mean 'digits'"]),
        (["train", "digits", "train.max_step=5"], ["Did you mean 'train.max_steps'"]),
        (["train", "digits", "--config", "/nonexistent/c.toml"], ["config file '/nonexistent/c.toml' does not exist"]),
        (["train", "digits", "--nproc-per-node", "3"], ["cannot be split evenly across 3 processes"]),
        (["train", "digits", "--nproc-per-node", "2", "train.micro_batch_size=20", "train.global_batch_size=100"],
         ["does not divide the 50 samples each of 2 processes", "1, 2, 5, 10, 25, 50"]),
        (["train", "digits", "--nproc-per-node", "4", "train.micro_batch_size=50"], ["valid train.micro_batch_size values for 4 processes: 1, 5, 25"]),
        (["train", "nosuchmodule:Exp"], ["cannot import module 'nosuchmodule'"]),
        (["train", "hpctrain.cli:main"], ["is not an hpctrain Experiment subclass"]),
        (["train", "digits", "run.dir=/etc/hostname/run"], ["is not writable"]),
    ],
)
def test_bad_input_is_a_message_not_a_traceback(capsys, argv, words):
    code, out, err = run(capsys, *argv)
    assert code == 2
    assert "Traceback" not in err and err.startswith("hpctrain: error: ")
    assert "HINT:" in err
    for w in words:
        assert w in err


def test_debug_shows_the_traceback():
    from hpctrain.errors import UserError

    with pytest.raises(UserError):
        main(["train", "digts", "--debug"])


def test_unknown_option_is_rejected(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["train", "digits", "--nprocs", "2"])
    assert exc.value.code == 2


def test_overrides_may_follow_options(capsys):
    code, out, _ = run(capsys, "config", "digits", "--config", "/dev/null", "train.max_steps=3")
    assert code == 0 and "max_steps = 3" in out


def test_config_describe_lists_keys_with_docs(capsys):
    code, out, _ = run(capsys, "config", "digits", "--describe")
    assert code == 0
    assert "train.global_batch_size = 100" in out and "Samples per optimizer step" in out
    assert 'model.norm = "batch"' in out and "train.compile = false" in out  # TOML, as a file or key=value takes it
    assert "= False" not in out and "= '" not in out


def test_experiments_lists_the_built_ins(capsys):
    code, out, _ = run(capsys, "experiments")
    names = [line.split()[0] for line in out.splitlines() if not line.startswith(" ")]
    assert code == 0 and names == ["ddpm_cifar10", "ddpm_digits", "digits", "faceseg", "faceseg_celebamask"]


def test_checkpoint_of_another_experiment_is_refused_before_launch(capsys, tmp_path: Path):
    import json

    import torch

    from hpctrain.checkpoint import storage

    ckpt = tmp_path / "run" / "checkpoints"
    storage.write_checkpoint(ckpt, 4, {"model.pt": {"w": torch.zeros(1)}, "state.json": json.dumps({})}, {"experiment": "toy"})
    before = sorted(p.name for p in ckpt.rglob("*"))
    code, _, err = run(capsys, "train", "digits", f"run.dir={tmp_path / 'run'}", "--nproc-per-node", "2")
    assert code == 2 and "written by experiment 'toy', not 'digits'" in err
    assert sorted(p.name for p in ckpt.rglob("*")) == before


def test_user_facing_text_cites_the_source_not_a_developers_folder(capsys):
    """Users have no ../shared/seeds: `hpctrain experiments`, the reference configs, the experiments' docstrings and
    the README name the source (the blog post and its experiment) instead."""
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    texts = {p: p.read_text() for p in [root / "README.md", *sorted((root / "configs").glob("*.toml")),
                                        *sorted((root / "src" / "hpctrain" / "experiments").rglob("*.py"))]}
    assert not [str(p) for p, text in texts.items() if "shared/seeds" in text]
    assert main(["experiments"]) == 0
    listing = capsys.readouterr().out
    assert "seeds" not in listing and 'blog post "Multi-Node Distributed Training on HPC"' in listing
    assert "Multi-Node Distributed Training on HPC" in (root / "configs" / "ddpm_cifar10.toml").read_text()


def test_experiments_are_listed_with_whole_sentences(capsys):
    from hpctrain.commands.experiments import first_sentence

    doc = "One thing (e.g. this) over\n  two lines. Then more.\n\nDetails."
    assert first_sentence(doc) == "One thing (e.g. this) over two lines."
    assert main(["experiments"]) == 0
    entries = re.split(r"\n(?=\S)", capsys.readouterr().out.strip())
    assert len(entries) >= 5
    for entry in entries:
        text = " ".join(entry.split()[1:])
        assert text.endswith((".", ".)")), entry


def test_every_plan_option_is_described(capsys):
    with pytest.raises(SystemExit):
        main(["plan", "--help"])
    out = capsys.readouterr().out
    assert "--nodes N          nodes of the planned job" in out


def test_a_workers_command_line_gives_its_config(tmp_path: Path):
    # python -m hpctrain.launch reads the run's config from the workers' command line for its failure alert.
    from hpctrain.commands.train import config_from_argv

    cfg = config_from_argv(["train", "digits", "--debug", "train.max_steps=3", f"run.dir={tmp_path}"])
    assert cfg.experiment == "digits" and cfg.train.max_steps == 3 and cfg.run_dir == str(tmp_path)
    assert config_from_argv(["eval", "digits", "--resume", "never", f"run.dir={tmp_path}"]).ckpt.resume == "never"
    for argv in (["sample", str(tmp_path)], ["train", "no_such_experiment"], []):
        with pytest.raises(Exception):
            config_from_argv(argv)


def test_nproc_per_node_must_be_positive(capsys):
    for argv in (["train", "digits"], ["eval", "digits"], ["sample", "runs/x"]):
        assert main([*argv, "--nproc-per-node", "-1"]) == 2
        assert "--nproc-per-node must be positive, got -1" in capsys.readouterr().err
