"""A run that fails before writing anything (a bad [model] option, found when the experiment is built) leaves no
empty run dir behind; a run dir that existed before, or holds anything, is never removed."""

from pathlib import Path

from hpctrain.cli import main
from hpctrain.train.rundir import removed_if_left_empty

BAD_OPTION = ["train", "ddpm_digits", "model.norm_groups=7"]  # checked when the experiment is built


def test_a_bad_model_option_leaves_no_run_dir(tmp_path: Path, capsys):
    assert main([*BAD_OPTION, f"run.dir={tmp_path}/runs/bad"]) == 2
    assert "model.norm_groups=7" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []  # neither the run dir nor the runs/ folder made for it


def test_a_run_dir_that_existed_before_stays(tmp_path: Path, capsys):
    empty, earlier = tmp_path / "empty", tmp_path / "earlier"
    empty.mkdir()
    (earlier / "checkpoints").mkdir(parents=True)
    for run_dir in (empty, earlier):
        assert main([*BAD_OPTION, f"run.dir={run_dir}"]) == 2
    assert empty.is_dir() and (earlier / "checkpoints").is_dir()


def test_only_empty_folders_it_created_go(tmp_path: Path):
    with removed_if_left_empty(tmp_path / "a" / "b" / "run"):
        (tmp_path / "a" / "b" / "run").mkdir(parents=True)
        (tmp_path / "a" / "kept.txt").write_text("another run's")
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["a", "kept.txt"]
    with removed_if_left_empty(tmp_path / "x" / "run"):
        (tmp_path / "x" / "run").mkdir(parents=True)
        (tmp_path / "x" / "run" / "metrics.jsonl").write_text("{}")
    assert (tmp_path / "x" / "run" / "metrics.jsonl").is_file()
