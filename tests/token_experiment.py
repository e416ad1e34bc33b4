"""A sequence model whose loss is a sum over a varying number of tokens, for the token-loss tests (issue 40, section
4): sequences of 1 to 12 tokens, padded per batch, a per-token model in float64. As an Experiment (TokenLM,
'token_experiment:TokenLM': train_loss returns (sum, count), or the micro-batch's mean with model.mean=true, which
depends on the split), as a StepExperiment (TokenStep) and in a loop of its own (tests/token_loop.py)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.nn.functional import cross_entropy

from hpctrain import Datasets, Experiment, StepExperiment

VOCAB = 11
SETTINGS = {"train.global_batch_size": 8, "train.micro_batch_size": 4, "train.max_steps": 6, "log.every_steps": 1,
            "log.tensorboard": False, "log.plots": False, "optim.name": "sgd", "optim.momentum": 0.0,
            "optim.lr": 0.5, "optim.weight_decay": 0.0, "optim.schedule": "constant", "train.grad_clip": 1e9,
            "data.num_workers": 0}


def sequences(n: int = 64, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, 13, (n,), generator=g)
    return [torch.randint(0, VOCAB, (int(k),), generator=g) for k in lengths]


def pad(batch: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Tokens padded to the batch's longest sequence, and the mask of real ones."""
    longest = max(len(s) for s in batch)
    tokens = torch.zeros(len(batch), longest, dtype=torch.long)
    mask = torch.zeros(len(batch), longest, dtype=torch.bool)
    for i, s in enumerate(batch):
        tokens[i, :len(s)], mask[i, :len(s)] = s, True
    return tokens, mask


def build_lm() -> nn.Module:
    return nn.Sequential(nn.Embedding(VOCAB, 16), nn.Tanh(), nn.Linear(16, VOCAB)).double()


def token_loss(model: nn.Module, batch) -> tuple[torch.Tensor, torch.Tensor]:
    """(sum of the cross entropy of each real token's successor class, number of real tokens)."""
    tokens, mask = batch
    logits = model(tokens)
    target = (tokens * 3 + 1) % VOCAB
    per_token = cross_entropy(logits.reshape(-1, VOCAB), target.reshape(-1), reduction="none")
    return (per_token * mask.reshape(-1)).sum(), mask.sum()


@dataclass(frozen=True, kw_only=True)
class TokenOptions:
    mean: bool = False
    """Return the micro-batch's mean over its tokens instead of (sum, count): the split-dependent way."""


class TokenLM(Experiment):
    config_class = TokenOptions
    defaults = SETTINGS

    def build_model(self):
        return build_lm()

    def build_datasets(self):
        return Datasets(train=sequences(), collate_fn=pad)

    def train_loss(self, model, batch):
        total, count = token_loss(model, batch)
        return total / count if self.options.mean else (total, count)


class TokenStep(StepExperiment):
    defaults = SETTINGS

    def build_models(self):
        return {"lm": build_lm()}

    def build_optimizers(self, models):
        return {"sgd": torch.optim.SGD(models["lm"].parameters(), lr=self.cfg.optim.lr)}

    def build_datasets(self):
        return Datasets(train=sequences(), collate_fn=pad)

    def train_step(self, step):
        for batch, _ in step.micro_batches():
            total, count = token_loss(step.models["lm"], batch)
            step.backward((total, count))
            step.log(loss=(total.detach(), count))
        step.optimizer_step()
