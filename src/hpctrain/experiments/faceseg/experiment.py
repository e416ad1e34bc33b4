"""Face parsing: DeepLabV3+ labels every pixel of a face with one of CelebAMask-HQ's 19 classes.

Two experiments on the same code:

- ``faceseg_celebamask``, the reference run of the practitioner's blog post "Multi-Node Distributed Training on HPC" (2026-01-29): DeepLabV3+ ResNet-101 (output stride 16) on
  CelebAMask-HQ at 256x256, 16 images per GPU on 3 nodes x 2 GPUs (global batch 96), 27k/3k split. Its defaults
  are the pretrained variant (configs/faceseg_pretrained.toml: ImageNet backbone, 100 epochs);
  configs/faceseg_scratch.toml is the other (random init, 200 epochs, a higher learning rate).
- ``faceseg``: a ResNet-18 DeepLabV3+ on generated faces (``hpctrain synth faces``) in the release layout: the
  quality check that trains on 2 CPU cores (tools/faceseg_quality.py).

The validation metrics come from one 19 x 19 confusion matrix summed over batches and ranks
(:mod:`hpctrain.metrics.segmentation` states the conventions), so they are exact for any number of processes.
"""

from __future__ import annotations

import logging
import math
import shlex
from dataclasses import dataclass
from typing import Any, Literal, Mapping

import torch
import torch.nn.functional as F
from torch import nn

from hpctrain.datasets.sources.celebamask import CLASSES
from hpctrain.errors import UserError
from hpctrain.experiments.base import Datasets, Experiment
from hpctrain.metrics.segmentation import confusion_matrix, iou_table, segmentation_metrics
from hpctrain.experiments.outputs import Outputs

log = logging.getLogger("hpctrain")

IGNORE_INDEX = 255
"""Label of pixels that count nowhere (no loss, no metric)."""
MEAN = (0.485, 0.456, 0.406)
STD = (0.229, 0.224, 0.225)
"""ImageNet normalisation (what torchvision's pretrained backbones expect; harmless from scratch)."""


@dataclass(frozen=True, kw_only=True)
class FaceSegOptions:
    source: Literal["celebamask", "shards"] = "shards"
    """celebamask: the release layout (CelebA-HQ-img + CelebAMask-HQ-mask-anno, or generated faces), read per
    sample; shards: made by `hpctrain shard SRC OUT --format celebamask --resize 256` (faster, and the GPU-decode
    path)."""
    data_root: str = "data/celebamask-shards"
    """The release folder (source=celebamask) or the shard directory holding train/ and val/ (source=shards)."""
    image_size: int = 256
    """Side of the square images and label maps the model sees."""
    crop_scale: tuple[float, float] = (0.75, 1.0)
    """Training crop: a random square of this fraction of the side, resized to image_size, flipped with p=0.5
    (left/right classes swapped)."""
    gpu_decode: bool = False
    """source=shards: decode and crop the JPEGs on the GPU (nvJPEG); the loader only reads bytes."""
    backbone: Literal["resnet18", "resnet34", "resnet50", "resnet101"] = "resnet101"
    """torchvision ResNet under DeepLabV3+."""
    output_stride: Literal[8, 16] = 16
    """Backbone output stride (16: ASPP rates 6/12/18; 8: dilated layer3 too, rates doubled, ~3x the FLOPs)."""
    aspp_channels: int = 256
    """Channels of the ASPP branches and projection."""
    decoder_channels: int = 256
    """Channels of the decoder convolutions."""
    init: str = "imagenet"
    """Initial weights: scratch, imagenet (torchvision's ImageNet ResNet), coco (the backbone of torchvision's
    COCO-trained DeepLabV3) or PATH of a local .pt/.pth/.safetensors state dict. Read from torch's hub cache; never
    downloaded (a clear error says which file to put where). Used when training starts, not when it resumes."""
    backbone_lr_scale: float = 0.1
    """Learning rate of a pretrained backbone as a fraction of optim.lr (1.0 with init=scratch: nothing to keep)."""
    class_weights: tuple[float, ...] = ()
    """Cross-entropy weight per class (19 values, CLASSES order); empty: unweighted."""
    preview_images: int = 4
    """Fixed validation images (the first ones) in the comparison picture of the outputs."""


class FaceSegExperiment(Experiment):
    """DeepLabV3+ face parsing; mIoU from a confusion matrix."""

    name = "faceseg"
    config_class = FaceSegOptions
    main_metric = "miou"
    higher_is_better = True
    class_names = CLASSES

    def __init__(self, cfg) -> None:
        super().__init__(cfg)
        _check_options(self.options)
        self._val: Any = None
        self._constants: dict[torch.device, tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]] = {}

    def _on(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """(mean, std, class weights or None) on ``device``, made once: a torch.tensor(..., device=cuda) or a
        .to(cuda) per step is a blocking copy that synchronises the GPU every step."""
        if device not in self._constants:
            weights = self.options.class_weights
            self._constants[device] = (
                torch.tensor(MEAN, device=device).view(1, 3, 1, 1), torch.tensor(STD, device=device).view(1, 3, 1, 1),
                torch.tensor(weights, dtype=torch.float32, device=device) if weights else None)
        return self._constants[device]

    def build_model(self) -> nn.Module:
        from hpctrain.experiments.faceseg.model import DeepLabV3Plus

        o = self.options
        return DeepLabV3Plus(num_classes=len(CLASSES), backbone=o.backbone, output_stride=o.output_stride,
                             aspp_channels=o.aspp_channels, decoder_channels=o.decoder_channels)

    def init_weights(self, model: nn.Module) -> str | None:
        from hpctrain.experiments.faceseg.model import load_init

        return load_init(model, self.options.init)

    def shard_dirs(self) -> list[str]:
        o = self.options
        return [f"{o.data_root}/train", f"{o.data_root}/val"] if o.source == "shards" else []

    def build_datasets(self) -> Datasets:
        from hpctrain.experiments.faceseg.data import build

        datasets = build(self.options, self.cfg.data)
        if datasets.val is None or len(datasets.val) == 0:
            raise UserError(f"no validation images in {self.options.data_root}",
                            "face parsing reports its mIoU on the validation split: use a set with a val split "
                            "(hpctrain synth faces writes one; 10% of the images).")
        self._val = datasets.val
        return datasets

    def param_groups(self, model: nn.Module) -> list[dict[str, Any]]:
        pretrained = self.options.init != "scratch"
        return [
            {"params": list(model.backbone_parameters()), "name": "backbone",
             "lr_scale": self.options.backbone_lr_scale if pretrained else 1.0},
            {"params": list(model.head_parameters()), "name": "head", "lr_scale": 1.0},
        ]

    # --- the step -------------------------------------------------------------------------------------------

    def _inputs(self, batch: Any, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """(normalised float images, long labels) on ``device`` from either batch form."""
        from hpctrain.data.gpu_decode import EncodedBatch

        if isinstance(batch, EncodedBatch):  # left on the host by hpctrain: nvJPEG reads host memory
            labels = batch.rest[0]
            images = batch.decode(device, self.options.image_size)  # floats in [0, 1]
            labels = labels.to(device, non_blocking=True)
        else:
            images, labels = batch[0].float().div_(255.0), batch[1]
        mean, std, _ = self._on(images.device)
        images = (images - mean) / std
        if self.cfg.train.channels_last_on:
            images = images.contiguous(memory_format=torch.channels_last)
        return images, labels.long()

    def _pixel_losses(self, model: nn.Module, batch: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        images, labels = self._inputs(batch, next(model.parameters()).device)
        logits = model(images)
        weight = self._on(logits.device)[2]
        losses = F.cross_entropy(logits.float(), labels, weight=weight, ignore_index=IGNORE_INDEX, reduction="none")
        return losses, logits, labels

    def _pixel_weights(self, labels: torch.Tensor) -> torch.Tensor:
        """Per pixel, the class weight (1 unweighted); 0 for ignored pixels: the denominator of a weighted mean."""
        valid = labels != IGNORE_INDEX
        weights = self._on(labels.device)[2]
        if weights is None:
            return valid.float()
        return torch.where(valid, weights[labels.clamp(0, len(CLASSES) - 1)], 0.0)

    def train_loss(self, model: nn.Module, batch: Any) -> torch.Tensor:
        # Cross-entropy's own mean (weighted by class weights, over labelled pixels), written out: reduction="mean"
        # divides by the weights' sum, which would be 0 for a crop of ignored pixels only (NaN), this by >= 1.
        losses, _, labels = self._pixel_losses(model, batch)
        return losses.sum() / self._pixel_weights(labels).sum().clamp(min=1.0)

    def eval_stats(self, model: nn.Module, batch: Any) -> Mapping[str, torch.Tensor]:
        losses, logits, labels = self._pixel_losses(model, batch)
        return {
            "loss_sum": losses.sum(),
            "count": self._pixel_weights(labels).sum(),
            # argmax of float32 logits: bf16 ties would go to the lower class and move the mIoU a little.
            "confusion": confusion_matrix(logits.float().argmax(1), labels, len(CLASSES), IGNORE_INDEX),
        }

    def metrics(self, totals: Mapping[str, Any]) -> dict[str, float]:
        out = {"loss": totals["loss_sum"] / max(totals["count"], 1.0)}
        out.update(segmentation_metrics(totals["confusion"], CLASSES))
        return out

    # --- pictures -------------------------------------------------------------------------------------------

    @torch.no_grad()
    def predict(self, model: nn.Module, images: list[torch.Tensor]) -> list[torch.Tensor]:
        """Per image (3 x H x W uint8, any size, on the model's device): the H x W class map, predicted at
        model.image_size and scaled back (logits resized bilinearly, then argmax)."""
        out = []
        for image in images:
            size = self.options.image_size
            x = F.interpolate(image[None].float(), size=(size, size), mode="bilinear", align_corners=False,
                              antialias=True).div_(255.0)
            mean, std, _ = self._on(x.device)
            logits = model((x - mean) / std).float()
            logits = F.interpolate(logits, size=tuple(image.shape[-2:]), mode="bilinear", align_corners=False)
            out.append(logits.argmax(1)[0])
        return out

    def preview(self, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The first k validation images (k x 3 x S x S uint8) and label maps (k x S x S), on the CPU."""
        from hpctrain.data.gpu_decode import decode_images
        from hpctrain.experiments.faceseg.data import resize_image

        val = self._val if self._val is not None else self.build_datasets().val
        if val is None or len(val) == 0:
            raise UserError("the validation set is empty, so there is nothing to preview",
                            "check model.data_root (it needs a val split).")
        images, labels = [], []
        for i in range(min(k, len(val))):
            image, label = val[i]
            if image.ndim == 1:  # gpu_decode: JPEG bytes
                image = decode_images([image], torch.device("cpu"))[0]
            images.append(resize_image(image, self.options.image_size))
            labels.append(label)
        return torch.stack(images), torch.stack(labels)

    def outputs(self, model: nn.Module, out: Outputs) -> None:
        """Rank 0: the comparison picture (image, ground truth, prediction) for the first model.preview_images
        validation images, and the curves so far. A few images: not worth splitting across ranks."""
        if not out.runtime.is_main:
            return
        from hpctrain.experiments.faceseg.figures import comparison_figure, curves_figure
        from hpctrain.metrics.records import read_metrics

        images, labels = self.preview(self.options.preview_images)
        with out.autocast():
            preds = self.predict(model, list(images.to(out.device)))
        pictures = [im.permute(1, 2, 0).numpy() for im in images]
        out.picture("comparison", comparison_figure(
            pictures, [("ground truth", list(labels)), (f"prediction (step {out.step})", preds)]))
        metrics = out.run_dir / "metrics.jsonl"
        if metrics.is_file():
            out.picture("curves", curves_figure(read_metrics(metrics), title=self.cfg.run_name))

    def describe_metrics(self, metrics: Mapping[str, float]) -> str:
        """The per-class IoU table the log shows after each validation."""
        return iou_table(dict(metrics), CLASSES)


class FaceSegCelebAMask(FaceSegExperiment):
    """The reference run, pretrained variant (see the module docstring; configs/faceseg_scratch.toml for the other).
    The source gives the model, data, batch, epochs and results, not the optimizer: SGD with Nesterov momentum 0.9,
    lr 0.01 (0.001 for the pretrained backbone), poly decay (power 0.9) after one epoch of warmup and weight decay
    1e-4 are DeepLab's usual recipe, chosen here."""

    name = "faceseg_celebamask"
    defaults = {
        "train.global_batch_size": 96,
        "train.micro_batch_size": 16,
        "train.epochs": 100,
        "train.grad_clip": 0.0,
        "train.channels_last": True,
        "optim.name": "sgd",
        "optim.lr": 0.01,
        "optim.momentum": 0.9,
        "optim.weight_decay": 1e-4,
        "optim.warmup_steps": 281,  # one epoch: 27,000 / 96
        "optim.schedule": "poly",
        "eval.micro_batch_size": 32,
        "log.every_steps": 50,
        "log.outputs_every_epochs": 5,
        "ckpt.every_minutes": 20.0,
    }


class FaceSegGenerated(FaceSegExperiment):
    """ResNet-18 DeepLabV3+ at 128x128 on generated faces, from scratch: trains on 2 CPU cores in minutes."""

    name = "faceseg"

    def build_datasets(self) -> Datasets:
        from pathlib import Path

        root = Path(self.options.data_root)
        if self.options.source == "celebamask" and not root.exists():
            raise UserError(f"no generated faces at {root}",
                            "generate them: " + shlex.join(["hpctrain", "synth", "faces", str(root), "--count", "3000"])
                            + " (about 45 s), or set "
                            "model.data_root.")
        return super().build_datasets()

    defaults = {
        "model.source": "celebamask",
        "model.data_root": "data/faces",
        "model.image_size": 128,
        "model.backbone": "resnet18",
        "model.aspp_channels": 128,
        "model.decoder_channels": 128,
        "model.init": "scratch",
        "train.global_batch_size": 32,
        "train.micro_batch_size": 16,
        "train.max_steps": 600,
        "train.grad_clip": 0.0,
        "optim.name": "sgd",
        "optim.lr": 0.05,
        "optim.momentum": 0.9,
        "optim.weight_decay": 1e-4,
        "optim.warmup_steps": 30,
        "optim.schedule": "poly",
        "eval.every_steps": 150,
        "log.every_steps": 25,
        "log.outputs_every_steps": 300,
        "ckpt.every_steps": 300,
    }


def _check_options(o: FaceSegOptions) -> None:
    if o.image_size < 32:
        raise UserError(f"model.image_size={o.image_size} is too small for DeepLabV3+ (stride 16)", "use 64 or more.")
    lo, hi = o.crop_scale
    if not 0 < lo <= hi <= 1:
        raise UserError(f"model.crop_scale={list(o.crop_scale)} is not 0 < low <= high <= 1", "e.g. [0.75, 1.0].")
    if o.class_weights and (len(o.class_weights) != len(CLASSES) or sum(o.class_weights) <= 0
                            or any(w < 0 or not math.isfinite(w) for w in o.class_weights)):
        raise UserError(f"model.class_weights has {len(o.class_weights)} values; it needs {len(CLASSES)} non-negative "
                        f"ones (not all 0), in the order {', '.join(CLASSES)}", "or leave it empty for an unweighted loss.")
    if o.backbone_lr_scale <= 0:
        raise UserError(f"model.backbone_lr_scale={o.backbone_lr_scale} must be positive",
                        "e.g. 0.1; freezing the backbone is not an option here.")
    if o.preview_images < 1:
        raise UserError(f"model.preview_images={o.preview_images} must be at least 1", "e.g. 4.")
    if o.gpu_decode and o.source != "shards":
        raise UserError("model.gpu_decode=true reads shards", "set model.source=shards (hpctrain shard ... --format "
                        "celebamask), or model.gpu_decode=false.")


__all__ = ["FaceSegCelebAMask", "FaceSegExperiment", "FaceSegGenerated", "FaceSegOptions"]
