"""The DDPM experiments' outputs: a grid of samples and a denoising strip, sampled on all ranks.

Sample i's starting noise and the noise of every ancestral step are drawn by i's position (Outputs.randn), so
the images do not depend on the number of processes that drew them. Each rank samples its share
(Outputs.share), rank 0 gathers and writes.
"""

from __future__ import annotations

import time

import torch
from torch import nn

from hpctrain.experiments.outputs import Outputs


def strip_timesteps(timesteps: int, columns: int) -> list[int]:
    """The denoising strip's columns: ``columns - 1`` timesteps from T-1 down to 0, evenly spaced, noisiest first,
    then -1, the final image (GaussianDiffusion.sample's record key for it). With DDIM the nearest visited
    timestep stands in for each."""
    k = columns - 1
    ts = [round((timesteps - 1) * (k - 1 - j) / max(k - 1, 1)) for j in range(k)] if k > 1 else [timesteps - 1]
    return ts + [-1]


def draw_samples(experiment, model: nn.Module, out: Outputs, n: int, steps: int, record: tuple[int, ...] = (),
                 record_rows: int = 0) -> tuple[torch.Tensor, dict[int, torch.Tensor], range]:
    """This rank's share of n samples in [-1, 1], drawn model.sample_batch at a time (50,000 samples do not fit
    one batch), and x_t at the ``record`` timesteps for the samples below ``record_rows``."""
    o = experiment.options
    mine = out.share(n)
    shape = (o.channels, o.image_size, o.image_size)
    parts: list[torch.Tensor] = []
    kept: dict[int, list[torch.Tensor]] = {t: [] for t in experiment.diffusion.recorded_keys(record, steps or None)}
    for begin in range(mine.start, mine.stop, o.sample_batch):
        items = range(begin, min(begin + o.sample_batch, mine.stop))
        rows = max(0, min(record_rows, items.stop) - items.start)  # of these, the ones the strip shows
        x0, recorded = _sample_items(experiment, model, out, items, shape, steps, record if rows else ())
        parts.append(x0)
        for t, x in recorded.items():
            kept[t].append(x[:rows])
    empty = torch.zeros((0, *shape), device=out.device)  # a rank without items (fewer samples than ranks)
    stacked = {t: torch.cat(xs) if xs else empty for t, xs in kept.items()}
    return (torch.cat(parts) if parts else empty), stacked, mine


def _sample_items(experiment, model: nn.Module, out: Outputs, items: range, shape: tuple[int, ...], steps: int,
                  record: tuple[int, ...]) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
    x_T = out.randn(items, *shape, stream=0)

    def noise(i: int, batch_shape: torch.Size) -> torch.Tensor:
        return out.randn(items, *batch_shape[1:], stream=1 + i)

    with out.autocast():
        x0, recorded = experiment.diffusion.sample(model, x_T, noise, steps=steps or None, record=record,
                                                   progress=lambda k, total: out.beat())
    return x0.float(), {t: x.float() for t, x in recorded.items()}


def sample_outputs(experiment, model: nn.Module, out: Outputs) -> None:
    o = experiment.options
    started = time.perf_counter()
    rows = strip_rows(o.samples, o.strip_samples)
    columns = strip_timesteps(o.timesteps, o.strip_columns) if rows else []
    x0, recorded, mine = draw_samples(experiment, model, out, o.samples, o.sample_steps, tuple(columns),
                                      record_rows=rows)
    images = out.gather(to_uint8(x0))
    out.image("samples", None if images is None else images.float() / 255)
    if rows:
        out.image("denoising", _strip(out, recorded, mine, rows), nrow=len(recorded))
    if out.runtime.is_main:
        out.log(sample_seconds=time.perf_counter() - started, samples=float(o.samples))


def strip_rows(samples: int, strip_samples: int) -> int:
    """Rows of the denoising strip: model.strip_samples, but never more than the samples drawn (`hpctrain sample
    --n 4` draws 4 and shows them all, whatever strip_samples says)."""
    return min(samples, strip_samples)


def _strip(out: Outputs, recorded: dict[int, torch.Tensor], mine: range, rows: int) -> torch.Tensor | None:
    """Rows: the first ``rows`` samples; columns: x_t at the recorded timesteps, then the final image."""
    states = torch.stack([recorded[t] for t in recorded], dim=1)  # this rank's strip rows x columns x C x H x W
    gathered = out.gather(to_uint8(states))
    if gathered is None:
        return None
    return gathered.flatten(0, 1).float() / 255  # row-major: sample by sample


def to_uint8(x: torch.Tensor) -> torch.Tensor:
    """[-1, 1] -> uint8 0..255: a quarter of the bytes to gather, and what a PNG holds anyway."""
    return ((x.clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8)
