"""DDPM (Ho et al. 2020): the U-Net learns the noise added to an image at a random timestep.

Two experiments on the same code: ``ddpm_cifar10`` (the reference run: 35.7M parameters, 100 epochs, global batch
384 = 64 x 6 GPUs, Adam 2e-4 with 5,000 warm-up steps, EMA 0.9999) and ``ddpm_digits`` (scikit-learn's bundled
digits upsampled to 16x16, a 1.1M-parameter U-Net: the quality check that trains on 2 CPU cores).

The timestep and the noise of every training sample are drawn by its position in the global batch
(BatchInfo), so a run on 1 x 4 and on 4 x 1 processes x accumulation trains identically; the validation loss
draws by position in the validation set, the same at every evaluation. Dropout still draws from each rank's
own stream: with model.dropout > 0 runs on different world sizes agree in distribution, not bit for bit.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal, Mapping

import torch
from torch import nn
from torch.utils.data import TensorDataset

from hpctrain.errors import UserError
from hpctrain.experiments.base import BatchInfo, Datasets, Experiment
from hpctrain.experiments.ddpm.diffusion import GaussianDiffusion
from hpctrain.experiments.ddpm.model import UNet
from hpctrain.experiments.outputs import Outputs

LOSS_BUCKETS = 4
"""The validation loss is also reported per quarter of the timestep range (loss_t0 = least noisy)."""


@dataclass(frozen=True, kw_only=True)
class DDPMOptions:
    source: Literal["cifar10", "shards", "digits", "fixture"] = "cifar10"
    """Training images: cifar10 (the official python batches under model.data_root), shards (made by `hpctrain
    shard --format cifar10`, under model.data_root/train and /test), digits (scikit-learn's bundled digits,
    upsampled), fixture (generated CIFAR-like patterns in memory: smoke tests)."""
    data_root: str = "data/cifar10"
    """Where the source lies: the folder holding cifar-10-batches-py, or the shard directory."""
    fixture_samples: int = 512
    """source=fixture: number of generated training images (and a quarter of that for validation)."""
    image_size: int = 32
    """Side of the square images the model sees (digits are upsampled from 8x8 to this)."""
    channels: int = 3
    """Image channels (3: CIFAR-10; 1: digits)."""
    ch: int = 128
    """U-Net base channels."""
    ch_mult: tuple[int, ...] = (1, 2, 2, 2)
    """Channel multipliers per resolution level (each level after the first halves the resolution)."""
    num_res_blocks: int = 2
    """Residual blocks per level."""
    attn_resolutions: tuple[int, ...] = (16,)
    """Resolutions with self-attention."""
    norm_groups: int = 32
    """GroupNorm groups (must divide every level's channels)."""
    dropout: float = 0.1
    """Dropout in the residual blocks."""
    timesteps: int = 1000
    """Diffusion steps T."""
    beta_start: float = 1e-4
    """First beta of the linear schedule."""
    beta_end: float = 0.02
    """Last beta of the linear schedule."""
    variance: Literal["large", "small"] = "large"
    """Ancestral sampling variance: large = beta_t (Ho et al. for CIFAR-10), small = the posterior's beta-tilde."""
    flip: bool = True
    """Random horizontal flip (training augmentation; off for digits, which are not mirror-symmetric)."""
    samples: int = 64
    """Samples drawn at each output (a grid); split across the ranks."""
    sample_steps: int = 100
    """DDIM steps for the outputs (eta 0); 0: ancestral DDPM sampling over all model.timesteps steps."""
    sample_batch: int = 256
    """Samples each rank draws at once (a forward pass of this batch per sampling step)."""
    strip_samples: int = 8
    """Samples shown in the denoising strip (rows; at most model.samples are shown)."""
    strip_columns: int = 10
    """Timesteps shown in the denoising strip (columns, noisiest first, the final image last)."""


class DDPMExperiment(Experiment):
    """Denoising diffusion; the validation metric is the epsilon-prediction MSE."""

    name = "ddpm"
    config_class = DDPMOptions
    main_metric = "loss"

    def __init__(self, cfg) -> None:
        super().__init__(cfg)
        o = self.options
        _check_options(o)
        self.diffusion = GaussianDiffusion(o.timesteps, o.beta_start, o.beta_end, o.variance)

    def build_model(self) -> nn.Module:
        o = self.options
        return UNet(ch=o.ch, ch_mult=o.ch_mult, num_res_blocks=o.num_res_blocks, attn_resolutions=o.attn_resolutions,
                    dropout=o.dropout, image_size=o.image_size, in_channels=o.channels, norm_groups=o.norm_groups)

    def shard_dirs(self) -> list[str]:
        o = self.options
        return [f"{o.data_root}/train", f"{o.data_root}/test"] if o.source == "shards" else []

    def build_datasets(self) -> Datasets:
        from hpctrain.experiments.ddpm.data import load_images

        train, val = load_images(self.options, self.cfg.data)
        flip = self.options.flip
        return Datasets(train=train, val=val, train_transform=_flip_sample if flip else None,
                        device_transform=_flip_batch if flip else None, device_draws=1)

    def _x0(self, batch: Any) -> torch.Tensor:
        """uint8 images -> floats in [-1, 1] (on the device: a quarter of the bytes cross the bus)."""
        x0 = batch[0].float().div_(127.5).sub_(1.0)
        return x0.contiguous(memory_format=torch.channels_last) if self.cfg.train.channels_last_on else x0

    def _losses(self, model: nn.Module, batch: Any, info: BatchInfo) -> tuple[torch.Tensor, torch.Tensor]:
        x0 = self._x0(batch)
        n = x0.shape[0]
        t = info.randint(self.options.timesteps, n, stream=0, device=x0.device)
        noise = info.randn(n, *x0.shape[1:], stream=1, device=x0.device)
        return self.diffusion.training_losses(model, x0, t, noise), t

    def train_loss(self, model: nn.Module, batch: Any, info: BatchInfo) -> torch.Tensor:
        return self._losses(model, batch, info)[0].mean()

    def eval_stats(self, model: nn.Module, batch: Any, info: BatchInfo) -> Mapping[str, torch.Tensor]:
        losses, t = self._losses(model, batch, info)
        bucket = t * LOSS_BUCKETS // self.options.timesteps
        return {
            "loss_sum": losses.sum(),
            "count": torch.tensor(float(len(losses))),
            # Tensor statistics: the loss per timestep quarter, summed over batches and ranks like the scalars.
            "bucket_loss": torch.zeros(LOSS_BUCKETS, device=losses.device).index_add_(0, bucket, losses.float()),
            # index_add_, not bincount: bincount sizes its output from the data, a device synchronisation on CUDA.
            "bucket_count": torch.zeros(LOSS_BUCKETS, device=losses.device).index_add_(
                0, bucket, torch.ones_like(losses, dtype=torch.float32)),
        }

    def metrics(self, totals: Mapping[str, Any]) -> dict[str, float]:
        out = {"loss": totals["loss_sum"] / max(totals["count"], 1.0)}
        per = totals["bucket_loss"] / totals["bucket_count"].clamp(min=1)
        out.update({f"loss_t{i}": float(v) for i, v in enumerate(per)})
        return out

    def outputs(self, model: nn.Module, out: Outputs) -> None:
        from hpctrain.experiments.ddpm.sampling import sample_outputs

        sample_outputs(self, model, out)


class DDPMCifar10(DDPMExperiment):
    """DDPM on CIFAR-10 as in the blog post "Multi-Node Distributed Training on HPC": 3 nodes x 2 GPUs, batch 384."""

    name = "ddpm_cifar10"
    defaults = {
        "train.global_batch_size": 384,
        "train.micro_batch_size": 64,
        "train.epochs": 100,
        "train.grad_clip": 1.0,
        "train.channels_last": "auto",  # NHWC convolutions on GPUs; NCHW under a graphed step (GroupNorm)
        "optim.name": "adamw",
        "optim.lr": 2e-4,
        "optim.weight_decay": 0.0,  # AdamW without decay is Adam, the reference's optimizer
        "optim.warmup_steps": 5000,
        "optim.schedule": "constant",
        "optim.ema_decay": 0.9999,
        "eval.micro_batch_size": 256,
        "log.every_steps": 50,
        "log.outputs_every_epochs": 10,
        "ckpt.every_minutes": 20.0,
    }


class DDPMDigits(DDPMExperiment):
    """The same code on scikit-learn's digits at 16x16 with a 1.1M-parameter U-Net: trains on 2 CPU cores in
    about 15 minutes, and its samples are recognisable digits (tools/ddpm_digits_quality.py scores them)."""

    name = "ddpm_digits"
    defaults = {
        "model.source": "digits",
        "model.image_size": 16,
        "model.channels": 1,
        "model.ch": 32,
        "model.ch_mult": (1, 2, 2),
        "model.num_res_blocks": 1,
        "model.attn_resolutions": (8,),
        "model.norm_groups": 8,
        "model.dropout": 0.0,
        "model.flip": False,
        "model.samples": 100,
        "model.sample_steps": 50,
        "train.global_batch_size": 128,
        "train.micro_batch_size": 64,
        "train.max_steps": 2400,
        "train.grad_clip": 1.0,
        "optim.lr": 1e-3,
        "optim.weight_decay": 0.0,
        "optim.warmup_steps": 100,
        "optim.schedule": "cosine",
        "optim.min_lr_ratio": 0.1,
        "optim.ema_decay": 0.995,
        "eval.every_steps": 500,
        "log.every_steps": 50,
        "log.outputs_every_steps": 1000,
        "ckpt.every_steps": 500,
    }


def _flip_sample(sample: tuple[torch.Tensor, ...], gen: torch.Generator) -> tuple[torch.Tensor, ...]:
    image, *rest = sample
    return (image.flip(-1) if torch.rand((), generator=gen) < 0.5 else image, *rest)


def _flip_batch(batch: tuple[torch.Tensor, ...], u: torch.Tensor) -> tuple[torch.Tensor, ...]:
    images, *rest = batch
    flip = (u[:, 0] < 0.5).view(-1, *([1] * (images.ndim - 1)))
    return (torch.where(flip, images.flip(-1), images), *rest)


def _check_options(o: DDPMOptions) -> None:
    if o.image_size % (2 ** (len(o.ch_mult) - 1)):
        raise UserError(f"model.image_size={o.image_size} is not divisible by 2^{len(o.ch_mult) - 1} "
                        f"(model.ch_mult has {len(o.ch_mult)} levels)",
                        "use an image size that halves cleanly at every level, or fewer levels.")
    bad = [o.ch * m for m in o.ch_mult if (o.ch * m) % o.norm_groups]
    if bad:
        raise UserError(f"model.norm_groups={o.norm_groups} does not divide the channel counts {bad}",
                        "choose norm_groups dividing model.ch x every model.ch_mult entry.")
    if o.sample_steps < 0 or o.sample_steps > o.timesteps:
        raise UserError(f"model.sample_steps={o.sample_steps} outside 0..{o.timesteps}",
                        "0 samples with all timesteps (ancestral); k uses k DDIM steps.")
    if o.samples < 1 or o.strip_samples < 0 or o.strip_columns < 2:
        raise UserError("model.samples must be >= 1, model.strip_samples >= 0, model.strip_columns >= 2",
                        f"got samples={o.samples}, strip_samples={o.strip_samples}, strip_columns={o.strip_columns}.")
    if o.sample_batch < 1:
        raise UserError(f"model.sample_batch={o.sample_batch} must be >= 1", "e.g. 256 on a GPU, 64 on a CPU.")
    if o.channels not in (1, 3):
        raise UserError(f"model.channels={o.channels}: images have 1 or 3 channels", "use 1 (digits) or 3.")


def as_tensor_dataset(images: torch.Tensor, labels: torch.Tensor) -> TensorDataset:
    """uint8 N x C x H x W images and their labels (kept for class-conditional uses and for inspection)."""
    return TensorDataset(images.contiguous(), labels)


__all__ = ["DDPMCifar10", "DDPMDigits", "DDPMExperiment", "DDPMOptions"]
