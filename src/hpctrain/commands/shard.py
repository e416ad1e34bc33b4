"""`hpctrain shard SOURCE OUT --format F`: pack a data set into WebDataset-format tar shards with an index
(datasets/shard_writer.py), or with --index-only index shards another tool wrote."""

from __future__ import annotations

import argparse
import logging

from hpctrain.errors import UserError

log = logging.getLogger("hpctrain")


def add_parser(sub) -> None:
    shard = sub.add_parser(
        "shard", help="pack a data set into WebDataset-format tar shards with an index (or --index-only DIR)",
        description="Writes OUT/<split>/<split>-NNNNNN.tar, index.json and manifest.json per split. "
        "Formats: cifar10 (cifar-10-batches-py), celebamask (CelebA-HQ-img + CelebAMask-HQ-mask-anno), "
        "imagefolder (SOURCE/[split/]class/image).",
    )
    shard.add_argument("source", help="the data set as published (or, with --index-only, a directory of .tar shards)")
    shard.add_argument("out", nargs="?", help="output directory (one sub-directory per split)")
    shard.add_argument("--format", choices=("cifar10", "celebamask", "imagefolder"), help="layout of SOURCE")
    shard.add_argument("--shard-size", default="1GB", metavar="SIZE", help="largest tar (default 1GB; e.g. 500MB, 64MiB)")
    shard.add_argument("--resize", type=int, default=0, metavar="PX",
                       help="pre-resize images so the shorter side is PX (celebamask: PX x PX); 0 keeps them")
    shard.add_argument("--download", action="store_true", help="download the source when missing (cifar10; needs internet)")
    shard.add_argument("--on-error", choices=("raise", "skip"), default="raise",
                       help="an unreadable source file stops (raise) or is left out and listed in the manifest (skip)")
    shard.add_argument("--force", action="store_true", help="replace existing complete splits in OUT")
    shard.add_argument("--index-only", action="store_true",
                       help="index the .tar shards in SOURCE (e.g. written by webdataset.ShardWriter) so hpctrain can read them")
    shard.add_argument("--debug", action="store_true", help="show tracebacks")
    shard.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from pathlib import Path

    from hpctrain.logs import setup_logging
    from hpctrain.units import parse_size

    setup_logging(debug=args.debug)
    if args.index_only:
        return index_only(Path(args.source))
    if not args.out or not args.format:
        raise UserError("hpctrain shard needs SOURCE, OUT and --format", "e.g. hpctrain shard data/ shards/ --format cifar10")
    if args.resize < 0:
        raise UserError(f"--resize must be 0 or positive, got {args.resize}")
    size = parse_size(args.shard_size)
    if size < 10_000:
        raise UserError(f"--shard-size {args.shard_size} is {size} bytes", "shards exist to be large; use e.g. 256MB to 1GB.")
    from hpctrain.datasets.shard_writer import ShardRequest, write_shards

    return write_shards(ShardRequest(Path(args.source), Path(args.out), args.format, size, args.resize, args.download,
                                     args.on_error, args.force))


def index_only(directory) -> int:
    """Index shards written by another tool (e.g. webdataset.ShardWriter) so hpctrain can read them."""
    import time

    from hpctrain.data.shards import index_directory

    started = time.perf_counter()
    n = index_directory(directory, {"dataset": "external", "indexed_by": "hpctrain shard --index-only"})
    log.info("indexed %d samples in %s (%.1f s)", n, directory, time.perf_counter() - started)
    return 0
