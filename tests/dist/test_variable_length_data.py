"""A user experiment whose data set is speech's natural form, a list of variable-length 1-D tensors with a padding
collate, trains with loader workers on one process (it crashed at the workers' start: 'ValueError: too many fds')."""

from pathlib import Path

import pytest

from tests.conftest import read_jsonl, run_hpctrain

pytestmark = [pytest.mark.dist, pytest.mark.timeout(300)]

SPEECH = '''
import torch, torch.nn.functional as F
from hpctrain.experiments import Datasets, Experiment

def utterances(n, seed):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(int(k), generator=g) + k % 2, int(k) % 2) for k in torch.randint(5, 80, (n,), generator=g)]

def pad(samples):
    x = torch.zeros(len(samples), max(len(s[0]) for s in samples))
    for i, (s, _) in enumerate(samples):
        x[i, :len(s)] = s
    return x, torch.tensor([s[1] for s in samples])

class Speech(Experiment):
    defaults = {"train.global_batch_size": 32, "train.micro_batch_size": 16, "train.max_steps": 4, "log.plots": False}
    def build_model(self):
        return torch.nn.Linear(1, 2)
    def build_datasets(self):
        return Datasets(train=utterances(1000, 1), val=utterances(64, 2), collate_fn=pad)
    def train_loss(self, model, batch):
        x, y = batch
        return F.cross_entropy(model(x.mean(1, keepdim=True)), y)
'''


def test_a_list_of_variable_length_tensors_trains_with_loader_workers(tmp_path: Path):
    (tmp_path / "speech.py").write_text(SPEECH)
    result = run_hpctrain(["train", "speech:Speech", "data.num_workers=2", "run.dir=run"], 240, cwd=tmp_path)
    assert result.returncode == 0, result.output
    steps = [r["step"] for r in read_jsonl(tmp_path / "run" / "metrics.jsonl") if r["split"] == "train"]
    assert steps and steps[-1] == 4
