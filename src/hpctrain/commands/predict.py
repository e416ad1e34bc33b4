"""`hpctrain predict RUN_DIR [IMAGES...] [--out DIR] [--compare OTHER_RUN]`: a trained segmentation run's masks
for images, or its comparison picture (the work: experiments/faceseg/predict.py)."""

from __future__ import annotations

import argparse
from pathlib import Path


def add_parser(sub) -> None:
    predict = sub.add_parser(
        "predict", help="coloured masks of a trained segmentation run for images, or its comparison picture",
        description="With IMAGES: DIR/<name>.png (coloured mask, the image's size) and DIR/<name>_labels.png (class "
        "indices). Without: DIR/comparison.png for the run's fixed validation images (image, ground truth, "
        "prediction). --compare adds another run's predictions (e.g. pretrained vs from scratch). One process; "
        "a GPU when there is one.",
    )
    predict.add_argument("run_dir", metavar="RUN_DIR", help="the run directory of a trained segmentation run")
    predict.add_argument("images", nargs="*", metavar="IMAGE", help="JPEG or PNG files")
    predict.add_argument("--out", default="", metavar="DIR", help="where the PNGs go (default RUN_DIR/predictions)")
    predict.add_argument("--compare", default="", metavar="RUN_DIR", help="a second run whose predictions to show")
    predict.add_argument("--resume", default="auto", metavar="auto|PATH",
                         help="RUN_DIR's checkpoint: the latest (auto, the default) or a checkpoint directory")
    predict.add_argument("--debug", action="store_true", help="show tracebacks")
    predict.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from hpctrain.experiments.faceseg.predict import read_images, write_predictions
    from hpctrain.logs import setup_logging
    from hpctrain.resolution import resolve_weights
    from hpctrain.train.sampling import check_out_dir

    setup_logging(debug=args.debug)
    run_dir = Path(args.run_dir).resolve()
    out = Path(args.out).resolve() if args.out else run_dir / "predictions"
    check_out_dir(out, run_dir)
    stems, inputs = read_images(args.images)
    runs = [resolve_weights(run_dir, args.resume)]
    if args.compare:
        runs.append(resolve_weights(Path(args.compare).resolve(), "auto"))
    for path in write_predictions(out, stems, inputs, runs):
        print(path, flush=True)
    return 0
