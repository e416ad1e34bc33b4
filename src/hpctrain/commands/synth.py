"""`hpctrain synth faces OUT`: a learnable stand-in data set in a real data set's on-disk layout."""

from __future__ import annotations

import argparse


def add_parser(sub) -> None:
    synth = sub.add_parser(
        "synth", help="generate a learnable stand-in data set in a real data set's on-disk layout",
        description="faces: drawn faces with all 19 CelebAMask-HQ classes (random pose, colours, background) in "
        "the CelebAMask-HQ release layout, with the standard split files; read by model.source=celebamask and by "
        "hpctrain shard --format celebamask. Written to a temporary folder and renamed into place.",
    )
    synth.add_argument("kind", choices=("faces",), help="which data set")
    synth.add_argument("out", metavar="OUT", help="folder to create (must not exist, or be empty)")
    synth.add_argument("--count", type=int, default=3000, help="images (default 3000: 80/10/10 train/val/test)")
    synth.add_argument("--size", type=int, default=256, help="image side in pixels (masks are half of it)")
    synth.add_argument("--seed", type=int, default=0, help="image i depends only on (seed, i)")
    synth.add_argument("--debug", action="store_true", help="show tracebacks")
    synth.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from pathlib import Path

    from hpctrain.datasets.synth import synth_faces
    from hpctrain.logs import setup_logging

    setup_logging(debug=args.debug)
    print(synth_faces(Path(args.out), args.count, args.size, args.seed), flush=True)
    return 0
