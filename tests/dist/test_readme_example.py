"""The README's "Writing an experiment" example, run exactly as printed (its code as mymodule.py, its command in the
same folder), and the message a user gets for a transform that loader workers cannot receive."""

import re
import shlex
from pathlib import Path

import pytest

from tests.conftest import TESTS, read_jsonl, run_hpctrain

pytestmark = [pytest.mark.dist, pytest.mark.timeout(600)]

README = TESTS.parent / "README.md"


def example() -> tuple[str, list[str]]:
    """(the python block, the hpctrain command's arguments) of the README's section."""
    text = README.read_text()
    section = text[text.index("## Writing an experiment"):]
    section = section[:section.index("\n## ", 10)]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    command = re.search(r"```bash\n(hpctrain [^\n#]*)", section).group(1)
    return code, shlex.split(command)[1:]


def test_the_readme_experiment_runs_as_printed(tmp_path: Path):
    code, args = example()
    assert code.startswith("# mymodule.py") and args[:2] == ["train", "mymodule:MyExperiment"]
    (tmp_path / "mymodule.py").write_text(code)
    result = run_hpctrain(args, 240, cwd=tmp_path)
    assert result.returncode == 0, result.output
    run_dir = tmp_path / "runs" / "mymodule_MyExperiment"
    val = [r for r in read_jsonl(run_dir / "metrics.jsonl") if r["split"] == "val"]
    assert val and val[-1]["accuracy"] > 0.9, val[-1:]
    one = run_hpctrain(["train", "mymodule:MyExperiment", "run.dir=one"], 240, cwd=tmp_path)  # and on one process
    assert one.returncode == 0, one.output


LAMBDA = '''
import torch, torch.nn.functional as F
from hpctrain.experiments import Datasets, Experiment

class Files(torch.utils.data.Dataset):                  # not in memory: the loader starts worker processes
    def __len__(self):
        return 64
    def __getitem__(self, i):
        return torch.full((4,), float(i % 2)), i % 2

class Exp(Experiment):
    def build_model(self):
        return torch.nn.Linear(4, 2)
    def build_datasets(self):
        return Datasets(train=Files(), val=Files(), train_transform=lambda sample, gen: sample)
    def train_loss(self, model, batch):
        x, y = batch
        return F.cross_entropy(model(x), y)
    def eval_stats(self, model, batch):
        x, y = batch
        return {"loss_sum": F.cross_entropy(model(x), y, reduction="sum"), "count": torch.tensor(float(len(y)))}
    def metrics(self, t):
        return {"loss": t["loss_sum"] / t["count"]}
'''


def test_a_transform_workers_cannot_receive_is_a_message_with_what_to_do(tmp_path: Path):
    (tmp_path / "lambdamod.py").write_text(LAMBDA)
    result = run_hpctrain(["train", "lambdamod:Exp", "data.num_workers=1", "data.worker_start=forkserver",
                           "train.global_batch_size=16", "train.micro_batch_size=16", "train.max_steps=2"], 120, cwd=tmp_path)
    assert result.returncode == 2, result.output
    assert "cannot be sent to the loader's worker processes" in result.stderr, result.output
    assert "define transforms and datasets at module level" in result.stderr and "data.num_workers=0" in result.stderr
    assert "Traceback" not in result.stderr
