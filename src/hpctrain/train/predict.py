"""`hpctrain predict RUN_DIR [IMAGES...] --out DIR [--compare OTHER_RUN]`: a trained segmentation run's
predictions, in one process (a GPU when there is one).

- With IMAGES: per image, ``<stem>.png`` (the coloured mask, the input's size) and ``<stem>_labels.png`` (the class
  indices as grey levels, for programs), and with --compare ``comparison.png`` (image, this run's prediction, the
  other run's).
- Without IMAGES: ``comparison.png`` for the run's fixed validation images (image, ground truth, prediction, and
  the other run's prediction with --compare): the pretrained-vs-scratch picture.

Weights: the checkpoint's shipped ones (EMA when present). Every file is written whole (temp file, rename).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Sequence

import torch

from hpctrain.errors import UserError
from hpctrain.metrics.images import write_png
from hpctrain.train.sample import check_out_dir, resolve_run

log = logging.getLogger("hpctrain")


def load_predictor(run_dir: Path, resume: str, device: torch.device):
    """(experiment, model in eval mode on ``device``, step) of a trained run."""
    from hpctrain.checkpoint.manager import Checkpointer
    from hpctrain.dist.runtime import single_process_runtime

    if resume == "never":
        raise UserError("--resume never loads no weights", "use --resume auto or a checkpoint directory.")
    cls, cfg = resolve_run(run_dir, (f"ckpt.resume={resume}",))
    experiment = cls(cfg)
    if not callable(getattr(experiment, "predict", None)):
        raise UserError(f"experiment '{cfg.experiment}' makes no per-pixel predictions (it has no predict method)",
                        "hpctrain predict is for segmentation runs, e.g. faceseg; use hpctrain sample for generators.")
    model = experiment.build_model()
    runtime = single_process_runtime(torch.device("cpu"))
    loaded = Checkpointer(run_dir, cfg.experiment, runtime, "", cfg.ckpt.keep_last).restore_weights(cfg.ckpt.resume,
                                                                                                   model)
    return experiment, model.to(device).eval(), int(loaded.info["step"])


def read_image(path: Path) -> torch.Tensor:
    """3 x H x W uint8, or a UserError naming the file."""
    from torchvision.io import ImageReadMode, decode_image

    if path.is_dir():
        raise UserError(f"'{path}' is a folder", "give image files (e.g. DIR/*.jpg).")
    if not path.is_file():
        raise UserError(f"image '{path}' does not exist", "give paths of JPEG or PNG files.")
    try:
        # EXIF orientation applied: a phone's portrait JPEG is predicted (and its mask written) the way it is shown.
        image = decode_image(torch.frombuffer(bytearray(path.read_bytes()), dtype=torch.uint8), mode=ImageReadMode.RGB,
                             apply_exif_orientation=True)
    except Exception as err:  # torchvision raises RuntimeError for unreadable files
        raise UserError(f"cannot read image '{path}' ({type(err).__name__})", "give JPEG or PNG files.") from None
    if image.dtype != torch.uint8:  # a 16-bit PNG decodes to uint16
        image = (image.to(torch.int32) >> 8).to(torch.uint8)
    return image


def predict_command(run_dir: Path, images: Sequence[str], out: Path | None, compare: Path | None,
                    resume: str = "auto") -> int:
    from hpctrain.experiments.faceseg.figures import colorize, comparison_figure

    out = out if out is not None else run_dir / "predictions"
    check_out_dir(out, run_dir)
    paths = [Path(p) for p in images]
    stems = [p.stem for p in paths]
    if len(set(stems)) != len(stems):
        raise UserError("two input images have the same file name, and their masks would overwrite each other",
                        "predict them in separate calls, or rename one.")
    inputs = [read_image(p) for p in paths]  # all read before anything is written
    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    runs = [load_predictor(run_dir, resume, device)]
    if compare is not None:
        runs.append(load_predictor(compare, "auto", device))
    columns: list[tuple[str, list[torch.Tensor]]] = []
    if inputs:
        shown = [im.permute(1, 2, 0).numpy() for im in inputs]
        for experiment, model, step in runs:
            columns.append((f"{_name(experiment)} (step {step})", _predict(experiment, model, inputs, device)))
        written = []
        for stem, mask in zip(stems, columns[0][1]):
            written.append(write_png(out / f"{stem}.png", colorize(mask)))
            written.append(write_png(out / f"{stem}_labels.png", mask.to(torch.uint8).cpu().numpy()[..., None]))
    else:
        experiment = runs[0][0]
        images, labels = experiment.preview(experiment.options.preview_images)
        shown = [im.permute(1, 2, 0).numpy() for im in images]
        columns.append(("ground truth", list(labels)))
        for run_experiment, model, step in runs:
            columns.append((f"{_name(run_experiment)} (step {step})",
                            _predict(run_experiment, model, list(images), device)))
        written = []
    if compare is not None or not inputs:
        written.append(write_png(out / "comparison.png", comparison_figure(shown, columns)))
    for path in written:
        print(path, flush=True)
    return 0


def _predict(experiment, model, images: list[torch.Tensor], device: torch.device) -> list[torch.Tensor]:
    with torch.no_grad():
        return [m.cpu() for m in experiment.predict(model, [im.to(device) for im in images])]


def _name(experiment) -> str:
    return experiment.cfg.run_name
