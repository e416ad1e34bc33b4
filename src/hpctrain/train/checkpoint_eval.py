"""`hpctrain eval`'s work in each rank: a checkpoint's weights validated with any number of processes, nothing
trained or written. Training's validation during a run is train/evaluate.py's ``evaluate``, which this calls."""

from __future__ import annotations

import json
import logging
from dataclasses import replace
from pathlib import Path

import torch

from hpctrain.checkpoint.manager import Checkpointer
from hpctrain.config.schema import RunConfig
from hpctrain.data.loader import build_loader
from hpctrain.data.sampler import EvalBatchSampler
from hpctrain.dist.runtime import Runtime
from hpctrain.errors import UserError
from hpctrain.experiments.base import Experiment
from hpctrain.train.choices import choose_launch
from hpctrain.train.evaluate import evaluate

log = logging.getLogger("hpctrain")


def run_evaluation(cfg: RunConfig, runtime: Runtime, experiment_cls: type[Experiment],
                   config_text: str) -> dict[str, float]:
    """Validate a checkpoint's weights (the EMA ones when present) with any number of processes;
    ckpt.resume: auto = the run dir's latest, or a path. Trains nothing, writes nothing. The experiment is built
    once, from the config resolved for this launch (its memory format) and without data.stage_dir (unstaged)."""
    choices = choose_launch(unstaged(cfg), runtime, experiment_cls, training=False)
    cfg = choices.cfg
    experiment = experiment_cls(cfg)
    data = experiment.build_datasets()
    if data.val is None:
        raise UserError(f"experiment '{cfg.experiment}' has no validation set", "nothing to evaluate.")
    model = experiment.build_model().to(runtime.device)
    if cfg.train.channels_last_on:  # the weights in the batches' format (evaluate converts those), as in training
        model = model.to(memory_format=torch.channels_last)
    checkpointer = Checkpointer(Path(cfg.run_dir), cfg.experiment, runtime, config_text, cfg.ckpt.keep_last)
    loaded = checkpointer.restore_weights(cfg.ckpt.resume, model)
    step = int(loaded.info["step"])
    eval_batch = cfg.eval.micro_batch_size or 2 * cfg.train.micro_batch_size
    sampler = EvalBatchSampler(len(data.val), eval_batch, runtime.rank, runtime.world_size)
    loader = build_loader(data.val, sampler, cfg.data, runtime, collate_fn=data.collate_fn)
    metrics = evaluate(experiment, model, loader, runtime, choices.precision, cfg.train.channels_last_on,
                       seed=cfg.run.seed, step=step)
    if runtime.is_main:
        record = {"step": step, "split": "val", "checkpoint": str(loaded.path), **metrics}
        print(json.dumps(record, sort_keys=True), flush=True)
    return metrics


def unstaged(cfg: RunConfig) -> RunConfig:
    """The config without data.stage_dir: evaluation reads the validation set once, which a copy to every node
    (of the training split too: experiments build both) would only delay."""
    if cfg.data.stage_dir:
        log.info("hpctrain eval reads the shards where they are: data.stage_dir=%s is for training's epochs",
                 cfg.data.stage_dir)
    return replace(cfg, data=replace(cfg.data, stage_dir=""))
