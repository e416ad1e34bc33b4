"""Are ddpm_digits' samples digits? Scores a trained run with the digits demo's own classifier.

No GPU and no CIFAR-10 here, so this is the end-to-end check of the diffusion code: train ``ddpm_digits``
(about 15 minutes on 2 CPU cores), then

    python tools/ddpm_digits_quality.py RUN_DIR [--n 500] [--ddim-steps 50] [--out docs]

trains the digits demo (``hpctrain train digits``, MiniResNet, 100% validation accuracy) once on the real
digits, draws N samples from the run's EMA weights with DDIM, brings them back to 8x8 (area average of the
16x16 samples) and classifies them. It prints the fraction classified with confidence >= 0.9, the class
histogram and its total-variation distance from uniform (0: every class equally often; 0.9: one class only),
and writes the sample grid and the denoising strip as PNGs. Goal: >= 80% confident samples, every class present.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
import torch.nn.functional as F

from hpctrain.checkpoint.manager import Checkpointer
from hpctrain.dist.runtime import single_process_runtime
from hpctrain.experiments.ddpm.sampling import draw_samples, strip_timesteps, to_uint8
from hpctrain.experiments.digits.data import load_digits_tensors
from hpctrain.experiments.digits.model import MiniResNet
from hpctrain.metrics.images import image_grid, write_png
from hpctrain.metrics.sinks import MetricsLogger
from hpctrain.resolution import resolve_config as resolve
from hpctrain.experiments.outputs import Outputs

CONFIDENT = 0.9


def train_classifier(work: Path) -> tuple[torch.nn.Module, float]:
    """The digits demo, as `make demo` trains it (one process here), and its validation accuracy."""
    run_dir = work / "digits"
    cmd = [sys.executable, "-m", "hpctrain", "train", "digits", f"run.dir={run_dir}", "log.progress=off",
           "log.tensorboard=false", "log.plots=false"]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    _, cfg = resolve("digits", str(run_dir / "config.toml"), ())
    model = MiniResNet(in_channels=1, num_classes=10, width=cfg.model.width, norm=cfg.model.norm)
    Checkpointer(run_dir, "digits", single_process_runtime(), "", 1).restore_weights("auto", model)
    images, labels = load_digits_tensors()
    model.eval()
    with torch.no_grad():
        accuracy = (model(images).argmax(1) == labels).float().mean().item()
    return model, accuracy


def load_run(run_dir: Path):
    """The run's experiment and its shipped (EMA) weights, on the CPU."""
    cls, cfg = resolve(_experiment_name(run_dir), str(run_dir / "config.toml"), ())
    experiment = cls(cfg)
    model = experiment.build_model()
    loaded = Checkpointer(run_dir, cfg.experiment, single_process_runtime(), "", 1).restore_weights("auto", model)
    return experiment, model.eval(), int(loaded.info["step"])


def _experiment_name(run_dir: Path) -> str:
    for line in (run_dir / "config.toml").read_text().splitlines():
        if line.startswith("experiment"):
            return line.split("=", 1)[1].strip().strip('"')
    raise SystemExit(f"{run_dir}/config.toml names no experiment: is this a run directory?")


def score(classifier: torch.nn.Module, samples: torch.Tensor) -> dict:
    """samples: N x 1 x H x W in [0, 1] -> confident fraction, histogram, distance from uniform."""
    small = F.adaptive_avg_pool2d(samples, 8) if samples.shape[-1] != 8 else samples
    with torch.no_grad():
        probs = classifier(small).softmax(1)
    confidence, label = probs.max(1)
    confident = confidence >= CONFIDENT
    hist = torch.bincount(label[confident], minlength=10).float()
    share = hist / hist.sum().clamp(min=1)
    return {
        "confident_fraction": confident.float().mean().item(),
        "histogram": [int(h) for h in hist],
        "tv_from_uniform": 0.5 * (share - 0.1).abs().sum().item(),
        "classes_present": int((hist > 0).sum()),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run_dir", type=Path, help="a trained ddpm_digits run directory")
    parser.add_argument("--n", type=int, default=500, help="samples to draw and classify (default 500)")
    parser.add_argument("--ddim-steps", type=int, default=50, help="DDIM steps (default 50)")
    parser.add_argument("--out", type=Path, default=None, help="write the sample grid and strip PNGs here")
    parser.add_argument("--json", type=Path, default=None, help="write the scores as JSON")
    args = parser.parse_args(argv)
    torch.set_num_threads(os.cpu_count() or 1)
    experiment, model, step = load_run(args.run_dir)
    with tempfile.TemporaryDirectory() as work:
        classifier, accuracy = train_classifier(Path(work))
        out = Outputs(single_process_runtime(), step, 0, True, seed=1234, run_dir=args.run_dir,
                      metrics=MetricsLogger([]))
        columns = strip_timesteps(experiment.options.timesteps, 10)
        x0, recorded, _ = draw_samples(experiment, model, out, args.n, args.ddim_steps, tuple(columns), record_rows=8)
    samples = to_uint8(x0).float() / 255
    result = {"run_dir": str(args.run_dir), "step": step, "n": args.n, "ddim_steps": args.ddim_steps,
              "classifier_accuracy": accuracy, **score(classifier, samples),
              "date": datetime.date.today().isoformat()}
    print(_table(result))
    if args.out:
        write_png(args.out / "ddpm-digits-samples.png", image_grid(_larger(samples[:100]), nrow=10))
        strip = torch.stack([recorded[t][:8] for t in recorded], dim=1).flatten(0, 1)
        write_png(args.out / "ddpm-digits-denoising.png",
                  image_grid(_larger(to_uint8(strip).float() / 255), nrow=len(recorded)))
        print(f"wrote {args.out}/ddpm-digits-samples.png and ddpm-digits-denoising.png")
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
    goal = result["confident_fraction"] >= 0.8 and result["classes_present"] == 10
    print(f"goal (>= 80% confident, every class present): {'met' if goal else 'NOT met'}")
    return 0


def _larger(images: torch.Tensor, factor: int = 3) -> torch.Tensor:
    """16-pixel digits are hard to see in a README: pixel-doubled (nearest), not smoothed."""
    return F.interpolate(images, scale_factor=factor, mode="nearest")


def _table(r: dict) -> str:
    rows = [
        ("run", f"{r['run_dir']} (step {r['step']})"),
        ("samples", f"{r['n']} (DDIM, {r['ddim_steps']} steps)"),
        ("classifier accuracy on the 1,797 real digits", f"{r['classifier_accuracy']:.4f}"),
        (f"confident samples (p >= {CONFIDENT})", f"{r['confident_fraction']:.1%}"),
        ("classes present among confident samples", f"{r['classes_present']} of 10"),
        ("class histogram (0..9)", " ".join(str(h) for h in r["histogram"])),
        ("total-variation distance from uniform", f"{r['tv_from_uniform']:.3f}"),
    ]
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"| {k:<{width}} | {v} |" for k, v in rows)


if __name__ == "__main__":
    sys.exit(main())
