"""A trained segmentation run's predictions (`hpctrain predict`: commands/predict.py), in one process (a GPU when
there is one).

- With images: per image, ``<stem>.png`` (the coloured mask, the input's size) and ``<stem>_labels.png`` (the class
  indices as grey levels, for programs), and with a second run ``comparison.png`` (image, this run's prediction,
  the other run's).
- Without images: ``comparison.png`` for the run's fixed validation images (image, ground truth, prediction, and
  the other run's prediction with a second run): the pretrained-vs-scratch picture.

Weights: the checkpoint's shipped ones (EMA when present). Every file is written whole (temp file, rename).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Sequence

import torch

from hpctrain.config.schema import RunConfig
from hpctrain.errors import UserError
from hpctrain.experiments.base import Experiment
from hpctrain.metrics.images import write_png

log = logging.getLogger("hpctrain")


def load_predictor(cls: type[Experiment], cfg: RunConfig, device: torch.device):
    """(experiment, model in eval mode on ``device``, step) of a trained run: its own config (resolution.resolve_run)
    and the checkpoint cfg.ckpt.resume."""
    from hpctrain.checkpoint.manager import Checkpointer
    from hpctrain.dist.runtime import single_process_runtime

    experiment = cls(cfg)
    if not callable(getattr(experiment, "predict", None)):
        raise UserError(f"experiment '{cfg.experiment}' makes no per-pixel predictions (it has no predict method)",
                        "hpctrain predict is for segmentation runs, e.g. faceseg; use hpctrain sample for generators.")
    model = experiment.build_model()
    runtime = single_process_runtime(torch.device("cpu"))
    loaded = Checkpointer(Path(cfg.run_dir), cfg.experiment, runtime, "", cfg.ckpt.keep_last).restore_weights(
        cfg.ckpt.resume, model)
    return experiment, model.to(device).eval(), int(loaded.info["step"])


def read_image(path: Path) -> torch.Tensor:
    """3 x H x W uint8, or a UserError naming the file."""
    from hpctrain.data.image_decode import decode_image

    if path.is_dir():
        raise UserError(f"'{path}' is a folder", "give image files (e.g. DIR/*.jpg).")
    if not path.is_file():
        raise UserError(f"image '{path}' does not exist", "give paths of JPEG or PNG files.")
    try:
        # EXIF orientation applied: a phone's portrait JPEG is predicted (and its mask written) the way it is shown.
        image = decode_image(torch.frombuffer(bytearray(path.read_bytes()), dtype=torch.uint8), "RGB")
    except Exception as err:  # both decoders raise RuntimeError for unreadable files
        raise UserError(f"cannot read image '{path}' ({type(err).__name__})", "give JPEG or PNG files.") from None
    if image.dtype != torch.uint8:  # a 16-bit PNG decodes to uint16
        image = (image.to(torch.int32) >> 8).to(torch.uint8)
    return image


def read_images(images: Sequence[str]) -> tuple[list[str], list[torch.Tensor]]:
    """(file stems, images), all read before anything is written; two images of one file name are refused (their
    masks would overwrite each other)."""
    paths = [Path(p) for p in images]
    stems = [p.stem for p in paths]
    if len(set(stems)) != len(stems):
        raise UserError("two input images have the same file name, and their masks would overwrite each other",
                        "predict them in separate calls, or rename one.")
    return stems, [read_image(p) for p in paths]


def write_predictions(out: Path, stems: Sequence[str], inputs: Sequence[torch.Tensor],
                      runs: Sequence[tuple[type[Experiment], RunConfig]]) -> list[Path]:
    """The masks of ``inputs`` by the first run (and comparison.png with every run's), or without inputs
    comparison.png of the first run's validation images; returns the files written."""
    from hpctrain.experiments.faceseg.figures import colorize, comparison_figure

    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    predictors = [load_predictor(cls, cfg, device) for cls, cfg in runs]
    columns: list[tuple[str, list[torch.Tensor]]] = []
    written = []
    if inputs:
        shown = [im.permute(1, 2, 0).numpy() for im in inputs]
        for experiment, model, step in predictors:
            columns.append((f"{_name(experiment)} (step {step})", _predict(experiment, model, list(inputs), device)))
        for stem, mask in zip(stems, columns[0][1]):
            written.append(write_png(out / f"{stem}.png", colorize(mask)))
            written.append(write_png(out / f"{stem}_labels.png", mask.to(torch.uint8).cpu().numpy()[..., None]))
    else:
        experiment = predictors[0][0]
        images, labels = experiment.preview(experiment.options.preview_images)
        shown = [im.permute(1, 2, 0).numpy() for im in images]
        columns.append(("ground truth", list(labels)))
        for run_experiment, model, step in predictors:
            columns.append((f"{_name(run_experiment)} (step {step})",
                            _predict(run_experiment, model, list(images), device)))
    if len(runs) > 1 or not inputs:
        written.append(write_png(out / "comparison.png", comparison_figure(shown, columns)))
    return written


def _predict(experiment, model, images: list[torch.Tensor], device: torch.device) -> list[torch.Tensor]:
    with torch.no_grad():
        return [m.cpu() for m in experiment.predict(model, [im.to(device) for im in images])]


def _name(experiment) -> str:
    return experiment.cfg.run_name
