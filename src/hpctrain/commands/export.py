"""`hpctrain export RUN_DIR`: a trained run's shipped weights, config and model card for a model hub (the
writing: hpctrain/export.py), from the run's own config and checkpoint, in this one process."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from hpctrain.errors import UserError


def add_parser(sub) -> None:
    export = sub.add_parser(
        "export", help="write a run's shipped weights (model.safetensors), config and a model card for a model hub",
        description="Writes DIR/model.safetensors (the EMA weights when present), DIR/config.toml and DIR/README.md "
        "(a model card), all at once through a temporary directory; or, with --out FILE.safetensors, that one file. "
        "From a checkpoint of any dist.strategy and number of processes.",
    )
    export.add_argument("run_dir", metavar="RUN_DIR", help="the run directory of a trained run")
    export.add_argument("--out", default="", metavar="DIR|FILE.safetensors",
                        help="export directory (default RUN_DIR/export), or a .safetensors file: the weights alone, "
                        "with the config in its metadata and beside it (FILE.toml)")
    which = export.add_mutually_exclusive_group()
    which.add_argument("--ema", dest="weights", action="store_const", const="ema",
                       help="the EMA weights (an error when the run has none); default: EMA when the run has them")
    which.add_argument("--raw", dest="weights", action="store_const", const="model",
                       help="the training weights, not the EMA ones")
    export.add_argument("--resume", default="auto", metavar="auto|PATH",
                        help="the checkpoint: the latest (auto, the default) or a checkpoint directory")
    export.add_argument("--to-trackers", action="store_true",
                        help="also log the export as a model artifact of the run's tracker runs (log.trackers: W&B, "
                        "MLflow; an offline W&B run gets it for its next wandb sync)")
    export.add_argument("--debug", action="store_true", help="show tracebacks")
    export.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from hpctrain.logs import setup_logging

    setup_logging(debug=args.debug)
    paths = export_run(Path(args.run_dir), Path(args.out) if args.out else None, args.resume, args.weights or "auto")
    for path in paths:
        print(path, flush=True)
    if args.to_trackers:
        to_trackers(Path(args.run_dir), paths)
    return 0


def to_trackers(run_dir: Path, paths: list[Path]) -> None:
    """The exported files as a model artifact of every tracker run the run dir's config names (log.trackers)."""
    from hpctrain.metrics.trackers.build import log_model_artifact
    from hpctrain.resolution import resolve_weights

    log = resolve_weights(run_dir, "auto")[1].log
    if not [t for t in log.trackers if t != "tensorboard"]:
        raise UserError(f"--to-trackers: the run in {run_dir} has no experiment tracker (log.trackers is empty)",
                        "the export is written; train with log.trackers=[\"wandb\"] or [\"mlflow\"] to track a run.")
    for name in log_model_artifact(run_dir, paths, log.trackers, log.tracker_timeout_s):
        print(f"hpctrain: export logged to {name} as a model artifact", file=sys.stderr, flush=True)


def export_run(run_dir: Path, out: Path | None = None, resume: str = "auto", weights: str = "auto") -> list[Path]:
    """Export RUN_DIR's checkpoint ``resume`` (auto: the latest, or a path) with the run's own config
    (export.export_weights); returns the files written. UserError (and nothing written) for a bad run dir."""
    from hpctrain.export import export_weights
    from hpctrain.resolution import resolve_weights

    cls, cfg = resolve_weights(run_dir, resume)
    return export_weights(cls, cfg, run_dir, out, weights)
