"""The README's "Bring your own training" examples, each run exactly as printed (its code under the file name its
first line gives, beside the README's mymodule.py; its commands in that folder), with what each must show."""

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import TESTS, kill_tree, read_jsonl

pytestmark = [pytest.mark.dist, pytest.mark.timeout(600)]

README = TESTS.parent / "README.md"


def section(title: str) -> str:
    text = README.read_text()
    part = text[text.index(f"## {title}"):]
    return part[:part.index("\n## ", 10)]


def examples(tmp_path: Path) -> list[list[str]]:
    """Write the section's files (and the mymodule.py it builds on); return its commands."""
    (tmp_path / "mymodule.py").write_text(re.search(r"```python\n(.*?)```", section("Writing an experiment"),
                                                    re.S).group(1))
    text = section("Bring your own training")
    for code in re.findall(r"```python\n(.*?)```", text, re.S):
        (tmp_path / code.splitlines()[0].removeprefix("# ").strip()).write_text(code)
    return [shlex.split(line, comments=True) for block in re.findall(r"```bash\n(.*?)```", text, re.S)
            for line in block.splitlines() if line.strip()]


def run(command: list[str], cwd: Path) -> subprocess.CompletedProcess:
    """A command as a user types it: hpctrain and torchrun from this Python's environment."""
    bin_dir = Path(sys.executable).parent
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "PYTHONPATH": os.environ.get(
        "PYTHONPATH", "")}
    env.pop("RANK", None)
    proc = subprocess.Popen(command, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=240)
    except subprocess.TimeoutExpired:
        kill_tree(proc.pid)
        proc.communicate(timeout=30)
        pytest.fail(f"{' '.join(command)} hung (hard timeout)")
    assert proc.returncode == 0, f"{' '.join(command)}\n{out}\n{err}"
    return subprocess.CompletedProcess(command, proc.returncode, out, err)


def test_every_example_of_bring_your_own_training_runs_as_printed(tmp_path: Path):
    commands = examples(tmp_path)
    assert [c[:3] for c in commands] == [["hpctrain", "train", "myadafactor:MyAdafactor"],
                                         ["hpctrain", "train", "mygan:MyGAN"],
                                         ["hpctrain", "train", "myloop.py"],
                                         ["hpctrain", "check", "resume"]]
    results = [run(command, tmp_path) for command in commands]
    adafactor = [r for r in read_jsonl(tmp_path / "runs" / "myadafactor_MyAdafactor" / "metrics.jsonl")
                 if r["split"] == "val"]
    assert adafactor[-1]["accuracy"] > 0.9  # the README's task, learnt by an optimizer of the experiment's choice
    assert "step: eager (auto: not graphed" in results[0].stderr
    gan = [r for r in read_jsonl(tmp_path / "runs" / "mygan_MyGAN" / "metrics.jsonl") if r["split"] == "train"]
    assert gan[-1]["step"] == 320 and gan[-1]["lr_g"] < gan[0]["lr_g"] and {"loss_d", "loss_g"} <= set(gan[-1])
    loop = [r for r in read_jsonl(tmp_path / "runs" / "myloop" / "metrics.jsonl") if r["split"] == "train"]
    assert loop[-1]["step"] == 96 and loop[-1]["loss"] < loop[0]["loss"]
    assert "resumed exactly" in results[3].stdout
