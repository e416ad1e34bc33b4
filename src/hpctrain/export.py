"""A trained run's shipped weights, packaged for a model hub (`hpctrain export RUN_DIR`: commands/export.py).

DIR/model.safetensors holds the weights that ship (the EMA ones when the checkpoint has them, else the model's)
as plain, contiguous CPU tensors; DIR/config.toml is the run's config; DIR/README.md is a model card (what was
trained, how long, the last validation metrics, how to load it) with the run's latest sample grid beside it
when there is one. Everything is written into a temporary directory first and renamed into place, so DIR is
either the previous export or the whole new one, never half of one.
"""

from __future__ import annotations

import logging
import os
import shutil
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from hpctrain.atomic import fsync_dir, give_new_file_mode
from hpctrain.config.schema import RunConfig
from hpctrain.errors import UserError
from hpctrain.experiments import Experiment
from hpctrain.metrics.records import metric_values, read_metrics
from hpctrain.train.state import TrainState

log = logging.getLogger("hpctrain")

WEIGHTS = "model.safetensors"
SAMPLE_IMAGE = "samples.png"


@dataclass(frozen=True)
class ModelCard:
    """What the model card says, gathered from the run dir (render_model_card turns it into Markdown)."""

    experiment: str
    run_name: str
    parameters: int
    checkpoint: str
    """The checkpoint directory's name, e.g. step_00000040."""
    step: int
    epoch: int
    """Epochs completed."""
    step_in_epoch: int
    samples_seen: int
    global_batch_size: int
    ema_decay: float
    """> 0: the weights are the EMA ones; 0: the model's own."""
    val_step: int | None = None
    """The step of the validation metrics below (None: no validation was logged)."""
    val: dict[str, float] = field(default_factory=dict)
    sample_image: str = ""
    """File name of the sample grid next to the card ('' when the run wrote none)."""


def render_model_card(card: ModelCard) -> str:
    """The README.md of an export (pure: the same card gives the same text)."""
    epochs = f"{card.epoch} epoch{'s' if card.epoch != 1 else ''}"
    if card.step_in_epoch:
        epochs += f" and {card.step_in_epoch} step{'s' if card.step_in_epoch != 1 else ''}"
    weights = f"EMA of the training weights (decay {card.ema_decay:g})" if card.ema_decay > 0 else \
        "the training weights (no EMA)"
    lines = [
        f"# {card.run_name}",
        "",
        f"Weights of an hpctrain run of the experiment `{card.experiment}`, exported from checkpoint "
        f"`{card.checkpoint}`.",
        "",
        "| | |",
        "|---|---|",
        f"| experiment | `{card.experiment}` |",
        f"| parameters | {card.parameters:,} |",
        f"| training | {card.step:,} steps ({epochs}), global batch {card.global_batch_size:,}, "
        f"{card.samples_seen:,} samples seen |",
        f"| weights | {weights} |",
        "",
    ]
    if card.val_step is not None and card.val:
        lines += [f"## Validation (step {card.val_step:,})", "", "| metric | value |", "|---|---|"]
        lines += [f"| {key} | {value:.4g} |" for key, value in sorted(card.val.items())]
        lines.append("")
    else:
        lines += ["## Validation", "", "No validation metrics were logged.", ""]
    if card.sample_image:
        lines += ["## Samples", "", f"![samples]({card.sample_image})", ""]
    lines += [
        "## Load",
        "",
        f"`{WEIGHTS}` holds the model's state dict; `config.toml` the run's config. In this directory:",
        "",
        "```python",
        "from safetensors.torch import load_file",
        "from hpctrain import resolve_config",
        f'cls, cfg = resolve_config("{card.experiment}", "config.toml")',
        "model = cls(cfg).build_model()",
        f'model.load_state_dict(load_file("{WEIGHTS}"))',
        "```",
        "",
    ]
    return "\n".join(lines)


def last_validation(metrics_path: Path, up_to_step: int) -> tuple[int | None, dict[str, float]]:
    """The last validation record at or before the exported step: (its step, its metrics); (None, {}) if none."""
    if not metrics_path.is_file():
        return None, {}
    vals = [r for r in read_metrics(metrics_path) if r["split"] == "val" and r["step"] <= up_to_step]
    if not vals:
        return None, {}
    return vals[-1]["step"], {k: float(v) for k, v in metric_values(vals[-1]).items()}


def latest_sample_grid(run_dir: Path, up_to_step: int) -> Path | None:
    """RUN_DIR/images/samples/step_NNNNNNN.png of the latest step at or before the exported one, or None."""
    steps = {}
    for path in (run_dir / "images" / "samples").glob("step_*.png"):
        digits = path.stem[len("step_"):]
        if digits.isdigit() and int(digits) <= up_to_step:
            steps[int(digits)] = path
    return steps[max(steps)] if steps else None


def shipped_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """The state dict as plain, contiguous CPU tensors, each with storage of its own (safetensors refuses
    tensors that share memory)."""
    return {k: v.detach().to("cpu").clone().contiguous() for k, v in model.state_dict().items()}


def check_out_dir(out: Path, run_dir: Path) -> None:
    """Refuse a destination that is not an export: an export replaces only a previous one (or an empty dir)."""
    resolved, checkpoints = out.resolve(), (run_dir / "checkpoints").resolve()
    if resolved == run_dir.resolve() or resolved == checkpoints or checkpoints in resolved.parents:
        raise UserError(f"--out '{out}' is the run directory or inside its checkpoints", "choose another folder, "
                        "e.g. RUN_DIR/export (the default).")
    if out.exists() and not out.is_dir():
        raise UserError(f"--out '{out}' exists and is not a directory", "choose another folder.")
    if out.is_dir() and any(out.iterdir()) and not (out / WEIGHTS).is_file():
        raise UserError(f"--out '{out}' is not empty and holds no previous export ({WEIGHTS})",
                        "choose an empty or new folder; an export replaces only an earlier export.")


def write_export(out: Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str], config_text: bytes,
                 card_text: str, sample: Path | None) -> list[Path]:
    """Write every file into a temporary sibling directory, then rename it into place (replacing an earlier
    export); nothing is left behind on failure."""
    from safetensors.torch import save_file

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.tmp-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        save_file(tensors, str(tmp / WEIGHTS), metadata=metadata)
        (tmp / "config.toml").write_bytes(config_text)
        if sample is not None:
            shutil.copyfile(sample, tmp / SAMPLE_IMAGE)
        (tmp / "README.md").write_text(card_text, encoding="utf-8")
        for path in tmp.iterdir():
            give_new_file_mode(path)
            with open(path, "rb") as f:
                os.fsync(f.fileno())
        fsync_dir(tmp)
        _swap_into_place(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return sorted(out.iterdir())


def _swap_into_place(tmp: Path, out: Path) -> None:
    old = None
    if out.exists():
        old = out.parent / f".{out.name}.old-{uuid.uuid4().hex[:8]}"
        os.rename(out, old)
    os.rename(tmp, out)
    fsync_dir(out.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def export_weights(cls: type[Experiment], cfg: RunConfig, run_dir: Path, out: Path | None = None,
                   weights: str = "auto") -> list[Path]:
    """Export the weights of RUN_DIR's checkpoint cfg.ckpt.resume (``weights``: auto = the EMA ones when the run
    has them, ema, or model), config and model card to ``out`` (default RUN_DIR/export); ``out`` ending in
    .safetensors writes that one file (the config in its metadata) and the config beside it (.toml), for inference
    code and model hubs. ``cls`` and ``cfg``: the run's own (resolution.resolve_run). Works from a checkpoint of
    any strategy and world size (torch.distributed.checkpoint reassembles the shards in this one process); returns
    the files written. UserError (and nothing written) for a bad checkpoint or destination."""
    from hpctrain.checkpoint.manager import Checkpointer
    from hpctrain.dist.runtime import single_process_runtime

    out = out if out is not None else run_dir / "export"
    single_file = out.suffix == ".safetensors"
    check_out_file(out, run_dir) if single_file else check_out_dir(out, run_dir)
    experiment = cls(cfg)
    model = experiment.build_model()
    runtime = single_process_runtime(torch.device("cpu"))
    loaded = Checkpointer(run_dir, cfg.experiment, runtime, "", cfg.ckpt.keep_last).restore_weights(
        cfg.ckpt.resume, model, weights)
    state = TrainState.from_dict(loaded.info)
    ema = "ema" in loaded.parts
    config_text = (run_dir / "config.toml").read_bytes()
    metadata = {"format": "pt", "experiment": cfg.experiment, "step": str(state.step), "ema": str(ema).lower(),
                "checkpoint": loaded.path.name}
    kind = "EMA" if ema else "model"
    parameters = sum(p.numel() for p in model.parameters())
    if single_file:
        written = write_weights_file(out, shipped_tensors(model), metadata | {"config": config_text.decode()}, config_text)
        log.info("exported %s (step %d, %s weights, %s parameters) to %s", cfg.experiment, state.step, kind,
                 f"{parameters:,}", out)
        return written
    val_step, val = last_validation(run_dir / "metrics.jsonl", state.step)
    sample = latest_sample_grid(run_dir, state.step)
    card = ModelCard(
        experiment=cfg.experiment, run_name=cfg.run_name, parameters=parameters,
        checkpoint=loaded.path.name, step=state.step, epoch=state.epoch, step_in_epoch=state.step_in_epoch,
        samples_seen=state.samples_seen, global_batch_size=state.global_batch_size or cfg.train.global_batch_size,
        ema_decay=cfg.optim.ema_decay if ema else 0.0, val_step=val_step, val=val,
        sample_image=SAMPLE_IMAGE if sample is not None else "",
    )
    written = write_export(out, shipped_tensors(model), metadata, config_text, render_model_card(card), sample)
    log.info("exported %s (step %d, %s weights, %s parameters) to %s", cfg.experiment, state.step, kind,
             f"{card.parameters:,}", out)
    return written


def check_out_file(out: Path, run_dir: Path) -> None:
    """A single-file export goes anywhere but into the checkpoints, and replaces only a file."""
    resolved, checkpoints = out.resolve(), (run_dir / "checkpoints").resolve()
    if checkpoints in resolved.parents:
        raise UserError(f"--out '{out}' is inside the run's checkpoints", "choose another path, e.g. RUN_DIR/model.safetensors.")
    if out.is_dir():
        raise UserError(f"--out '{out}' is a directory", "name the file, e.g. --out model.safetensors, or give a "
                        "directory name without the .safetensors suffix for the full export with its model card.")


def write_weights_file(out: Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str], config_text: bytes) -> list[Path]:
    """OUT.safetensors and OUT.toml (the config), each written to a temporary sibling and renamed over the old one:
    a reader sees the old file or the new one, never half of one."""
    from safetensors.torch import save_file

    out.parent.mkdir(parents=True, exist_ok=True)
    config = out.with_suffix(".toml")
    staged = []
    try:
        for final, write in ((out, lambda tmp: save_file(tensors, str(tmp), metadata=metadata)),
                             (config, lambda tmp: tmp.write_bytes(config_text))):
            tmp = final.with_name(f".{final.name}.tmp-{uuid.uuid4().hex[:8]}")
            staged.append(tmp)
            write(tmp)
            give_new_file_mode(tmp)
            with open(tmp, "rb") as f:
                os.fsync(f.fileno())
        for tmp, final in zip(staged, (out, config)):
            os.replace(tmp, final)
        fsync_dir(out.parent)
    except BaseException:
        for tmp in staged:
            tmp.unlink(missing_ok=True)
        raise
    return [out, config]
