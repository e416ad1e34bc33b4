"""digits with an outputs hook (loaded as 'tracker_experiment:DigitsWithPictures'): a small picture of the first
validation digits, so the tracker tests see the experiment's images reach W&B and MLflow."""

from __future__ import annotations

import torch

from hpctrain.experiments.digits.experiment import DigitsExperiment


class DigitsWithPictures(DigitsExperiment):
    def outputs(self, model, out) -> None:
        part = out.share(4)
        images = torch.rand(len(part), 1, 8, 8, generator=torch.Generator().manual_seed(out.step))
        out.image("digits", out.gather(images.to(out.device)))
