"""The `hpctrain` command: parse, delegate, turn errors into messages. No logic of its own."""

from __future__ import annotations

import argparse
import os
import re
import sys
import textwrap
from typing import NoReturn, Sequence

from hpctrain import __version__
from hpctrain.compat import check_torch
from hpctrain.errors import UserError
from hpctrain.process_exit import run_and_exit


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="hpctrain",
        description="Distributed PyTorch training for Slurm clusters: exact data order and metrics, "
        "resumable checkpoints.",
    )
    parser.add_argument("--version", action="version", version=f"hpctrain {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    train = sub.add_parser("train", help="train an experiment (locally, or inside torchrun/srun)")
    _add_run_args(train)
    _add_launch_args(train)
    train.set_defaults(func=_train, command_name="train")

    evaluate = sub.add_parser(
        "eval", help="validate a run's checkpoint (its latest, or --resume PATH) with the run's own config; prints JSON",
        description="hpctrain eval EXPERIMENT [run.dir=RUN_DIR] [--resume PATH] [--nproc-per-node N] [key=value ...]: "
        "reads RUN_DIR/config.toml (run.dir defaults to runs/EXPERIMENT) unless --config is given; key=value on top.")
    _add_run_args(evaluate)
    _add_launch_args(evaluate)
    evaluate.set_defaults(func=_train, command_name="eval")

    _add_sample_parser(sub)
    _add_export_parser(sub)
    _add_predict_parser(sub)

    config = sub.add_parser("config", help="print the resolved config as TOML, or --describe every key")
    _add_run_args(config)
    config.add_argument("--describe", action="store_true", help="list every key with its type, default and meaning")
    config.set_defaults(func=_config)

    _add_slurm_parser(sub)
    from hpctrain.sweep.cli import add_sweep_parser

    add_sweep_parser(sub, _add_run_args)

    plan = sub.add_parser("plan", help="estimate step time and scaling efficiency on N nodes x G GPUs from one "
                          "device's measured step and the bus bandwidth")
    _add_run_args(plan)
    plan.add_argument("--nodes", type=int, required=True, metavar="N", help="nodes of the planned job (estimates for 1..N)")
    plan.add_argument("--gpus-per-node", type=int, required=True, metavar="G", help="ranks per node")
    plan.add_argument("--busbw", type=float, default=0.0, metavar="GB/s",
                      help="all-reduce bus bandwidth between those ranks (nccl-tests' busbw)")
    plan.add_argument("--preflight", default="", metavar="PATH",
                      help="take the bandwidth from a 'hpctrain doctor --perf' report (preflight.json or its directory)")
    plan.add_argument("--steps", type=int, default=5, help="measured steps after two warm-up steps (default 5)")
    plan.add_argument("--json", action="store_true", help="print the estimate as JSON")
    plan.set_defaults(func=_plan)

    report = sub.add_parser("report", help="plots and a summary (Markdown + HTML) of a run dir's metrics and monitors, "
                            "or a sweep dir's comparison of its points")
    report.add_argument("run_dir", help="the run directory, or a sweep directory")
    report.add_argument("--debug", action="store_true", help="show tracebacks")
    report.set_defaults(func=_report)

    _add_shard_parser(sub)
    _add_synth_parser(sub)

    doctor = sub.add_parser("doctor", help="check the launch environment (inside a job: on every node via srun); "
                            "--perf measures bandwidth, matmul throughput and stragglers")
    doctor.add_argument("--json", action="store_true", help="print the findings as JSON")
    doctor.add_argument("--perf", action="store_true",
                        help="performance pre-flight on all ranks: all-reduce bandwidth (1 KiB up to --max-size), matrix "
                        "multiply TFLOP/s per rank, stragglers; writes preflight.json and preflight.md to --out")
    doctor.add_argument("--nproc-per-node", type=int, default=0, metavar="N", help="--perf: start N local ranks (torchrun)")
    doctor.add_argument("--out", default="", metavar="DIR", help="--perf: report directory (default runs/preflight-TIME)")
    doctor.add_argument("--max-size", default="0", metavar="SIZE",
                        help="--perf: largest all-reduce message (default 1GiB on GPUs, 64MiB on CPUs)")
    doctor.add_argument("--min-busbw", type=float, default=0.0, metavar="GB/s", help="--perf: fail below this bus bandwidth")
    doctor.add_argument("--min-tflops", type=float, default=0.0, metavar="TFLOP/s",
                        help="--perf: fail when a rank's matrix multiply is below this")
    doctor.add_argument("--max-straggler", type=float, default=1.5, metavar="RATIO",
                        help="--perf: fail when the slowest rank needs this many times the median time (default 1.5)")
    doctor.add_argument("--data", default="", metavar="PATH",
                        help="--perf: also probe reading this data directory, all ranks at once (file opens/s, MB/s)")
    doctor.add_argument("--data-size", default="256MiB", metavar="SIZE", help="--perf: bytes each rank reads of --data")
    doctor.add_argument("--min-read-mbps", type=float, default=0.0, metavar="MB/s",
                        help="--perf: fail when a rank reads --data slower than this")
    doctor.add_argument("--debug", action="store_true", help="show tracebacks")
    doctor.set_defaults(func=_doctor)

    experiments = sub.add_parser("experiments", help="list the built-in experiments")
    experiments.add_argument("--debug", action="store_true", help=argparse.SUPPRESS)
    experiments.set_defaults(func=_experiments)
    return parser


def _add_sample_parser(sub) -> None:
    sample = sub.add_parser(
        "sample", help="draw a trained run's samples (its outputs hook) from a checkpoint into PNGs",
        description="Loads RUN_DIR/config.toml (key=value overrides on top) and the checkpoint's weights (the EMA ones "
        "when present), runs the experiment's outputs hook split across the processes, writes the PNGs under --out "
        "and prints their paths. Writes nothing else into RUN_DIR.",
    )
    sample.add_argument("run_dir", metavar="RUN_DIR", help="the run directory of a trained run")
    sample.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides, e.g. run.seed=1")
    sample.add_argument("--n", type=int, metavar="N", help="samples to draw (model.samples)")
    sample.add_argument("--ddim-steps", type=int, metavar="K", help="DDIM steps (model.sample_steps); 0: ancestral")
    sample.add_argument("--out", default="", metavar="DIR", help="where the PNGs go (default RUN_DIR/samples)")
    sample.add_argument("--nproc-per-node", type=int, default=0, metavar="N",
                        help="start N local processes through torchrun (ignored when already launched)")
    sample.add_argument("--resume", metavar="auto|PATH", help="the checkpoint: the latest (auto, the default) or a "
                        "checkpoint directory")
    sample.add_argument("--debug", action="store_true", help="show tracebacks")
    sample.set_defaults(func=_sample, command_name="sample")


def _add_export_parser(sub) -> None:
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
    export.add_argument("--debug", action="store_true", help="show tracebacks")
    export.set_defaults(func=_export)


def _add_predict_parser(sub) -> None:
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
    predict.set_defaults(func=_predict)


def _predict(args: argparse.Namespace) -> int:
    from pathlib import Path

    from hpctrain.logs import setup_logging
    from hpctrain.train.predict import predict_command

    setup_logging(debug=args.debug)
    return predict_command(Path(args.run_dir).resolve(), args.images, Path(args.out).resolve() if args.out else None,
                           Path(args.compare).resolve() if args.compare else None, args.resume)


def _add_synth_parser(sub) -> None:
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
    synth.set_defaults(func=_synth)


def _synth(args: argparse.Namespace) -> int:
    from pathlib import Path

    from hpctrain.datasets.synth import synth_faces
    from hpctrain.logs import setup_logging

    setup_logging(debug=args.debug)
    print(synth_faces(Path(args.out), args.count, args.size, args.seed), flush=True)
    return 0


def _sample_request(args: argparse.Namespace):
    from pathlib import Path

    from hpctrain.train.entry import TrainRequest
    from hpctrain.train.sample import check_out_dir, sample_overrides

    if args.nproc_per_node < 0:
        raise UserError(f"--nproc-per-node must be positive, got {args.nproc_per_node}")
    run_dir = Path(args.run_dir).resolve()
    out = Path(args.out).resolve() if args.out else run_dir / "samples"
    check_out_dir(out, run_dir)
    overrides = tuple(args.overrides) + sample_overrides(args.n, args.ddim_steps, args.resume)
    return TrainRequest(str(run_dir), None, overrides, args.nproc_per_node, args.debug, "sample", out=str(out))


def _sample(args: argparse.Namespace) -> int:
    from hpctrain.train.entry import train_command

    return train_command(_sample_request(args))


def _export(args: argparse.Namespace) -> int:
    from pathlib import Path

    from hpctrain.logs import setup_logging
    from hpctrain.train.export import export_command

    setup_logging(debug=args.debug)
    return export_command(Path(args.run_dir), Path(args.out) if args.out else None, args.resume,
                          args.weights or "auto")


def _add_shard_parser(sub) -> None:
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
    shard.set_defaults(func=_shard)


def _shard(args: argparse.Namespace) -> int:
    from pathlib import Path

    from hpctrain.commands.shard import index_only as index_only_command
    from hpctrain.data.shard_writer import ShardRequest, write_shards as shard_command
    from hpctrain.units import parse_size
    from hpctrain.logs import setup_logging

    setup_logging(debug=args.debug)
    if args.index_only:
        return index_only_command(Path(args.source))
    if not args.out or not args.format:
        raise UserError("hpctrain shard needs SOURCE, OUT and --format", "e.g. hpctrain shard data/ shards/ --format cifar10")
    if args.resize < 0:
        raise UserError(f"--resize must be 0 or positive, got {args.resize}")
    size = parse_size(args.shard_size)
    if size < 10_000:
        raise UserError(f"--shard-size {args.shard_size} is {size} bytes", "shards exist to be large; use e.g. 256MB to 1GB.")
    req = ShardRequest(Path(args.source), Path(args.out), args.format, size, args.resize, args.download,
                       args.on_error, args.force)
    return shard_command(req)


def _add_slurm_parser(sub) -> None:
    slurm = sub.add_parser("slurm", help="render, check, submit and follow Slurm jobs")
    ssub = slurm.add_subparsers(dest="slurm_command", required=True, metavar="SUBCOMMAND")
    for name, text in (("render", "print the sbatch script"), ("check", "lint the job (exit 1 on errors)"),
                       ("submit", "check, write the script into the run dir, sbatch it, print the job id")):
        p = ssub.add_parser(name, help=text)
        _add_run_args(p)
        if name == "submit":
            p.add_argument("--force", action="store_true",
                           help="submit despite errors found by the check, or when Slurm did not answer whether the "
                                "run dir's job still runs")
            p.add_argument("--preflight", action="store_true",
                           help="run hpctrain doctor --perf on all ranks first; a failed check ends the job before "
                           "training (same as slurm.preflight=true; options in slurm.preflight_args)")
        p.set_defaults(func=_slurm, command_name=name)
    for name, text in (("status", "Slurm state and training progress"), ("cancel", "cancel the job"),
                       ("logs", "print (or follow) the job's log")):
        p = ssub.add_parser(name, help=text)
        p.add_argument("target", metavar="RUN_DIR|JOB_ID",
                       help="a run dir submitted from, a job id, or a sweep's array task (JOBID_INDEX)")
        p.add_argument("--debug", action="store_true", help="show tracebacks")
        if name == "cancel":
            p.add_argument("--signal", default="", metavar="SIG",
                           help="instead of cancelling, send SIG (e.g. USR2: checkpoint and requeue) to the job")
        if name == "logs":
            p.add_argument("-n", "--lines", type=int, default=40, help="lines from the end (default 40)")
            p.add_argument("-f", "--follow", action="store_true",
                           help="keep printing as the log grows, until the job ends")
        p.set_defaults(func=_slurm, command_name=name)


def _slurm(args: argparse.Namespace) -> int:
    from hpctrain.slurm import commands

    name = args.command_name
    if name in ("render", "check", "submit"):
        sources = (args.experiment, args.config_file, tuple(args.overrides))
        if name == "render":
            return commands.render_command(*sources)
        if name == "check":
            return commands.check_command(*sources)
        if args.preflight:
            sources = (args.experiment, args.config_file, tuple(args.overrides) + ("slurm.preflight=true",))
        return commands.submit_command(*sources, force=args.force)
    if name == "status":
        return commands.status_command(args.target)
    if name == "cancel":
        return commands.cancel_command(args.target, args.signal)
    return commands.logs_command(args.target, args.lines, args.follow)


def _report(args: argparse.Namespace) -> int:
    from pathlib import Path

    if (Path(args.run_dir) / "sweep.toml").is_file():  # a sweep dir: the comparison of its points
        from hpctrain.sweep.report import sweep_report_command

        return sweep_report_command(Path(args.run_dir))
    from hpctrain.monitor.report import report_command

    return report_command(args.run_dir)


def _doctor(args: argparse.Namespace) -> int:
    if args.perf:
        from hpctrain.units import parse_size
        from hpctrain.logs import setup_logging
        from hpctrain.commands.doctor import PerfRequest, perf_command
        from hpctrain.perf.preflight import Thresholds

        setup_logging(debug=args.debug)
        if args.max_straggler < 1:
            raise UserError(f"--max-straggler {args.max_straggler} is below 1", "it is the slowest / median ratio, e.g. 1.5.")
        thresholds = Thresholds(args.min_busbw, args.min_tflops, args.max_straggler, args.min_read_mbps)
        return perf_command(PerfRequest(args.nproc_per_node, args.out, parse_size(args.max_size), thresholds,
                                        args.data, parse_size(args.data_size)))
    from hpctrain.commands.doctor import environment_checks as doctor_command

    return doctor_command(as_json=args.json)


def _add_launch_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--nproc-per-node", type=int, default=0, metavar="N",
        help="start N local processes through torchrun (ignored when already launched by torchrun or srun)",
    )
    p.add_argument(
        "--resume", metavar="auto|never|PATH",
        help="shortcut for ckpt.resume=...: continue from the run dir's latest checkpoint (auto, the default), "
        "refuse a run dir with checkpoints (never), or start from a checkpoint directory",
    )


def _add_run_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("experiment", help="built-in experiment name (see 'hpctrain experiments') or package.module:Class")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides, e.g. train.max_steps=200")
    p.add_argument("--config", dest="config_file", metavar="FILE", help="TOML config file (below key=value overrides)")
    p.add_argument("--debug", action="store_true", help="show tracebacks")


def _request(args: argparse.Namespace):
    from hpctrain.train.entry import TrainRequest

    overrides = tuple(args.overrides) + ((f"ckpt.resume={args.resume}",) if args.resume else ())
    if args.nproc_per_node < 0:
        raise UserError(f"--nproc-per-node must be positive, got {args.nproc_per_node}")
    return TrainRequest(args.experiment, args.config_file, overrides, args.nproc_per_node, args.debug, args.command_name)


def request_from_argv(argv: Sequence[str]):
    """The TrainRequest of a `hpctrain train|eval|sample ...` command line (used by the torchrun wrapper)."""
    args = parse(argv)
    return _sample_request(args) if getattr(args, "command_name", "") == "sample" else _request(args)


def _train(args: argparse.Namespace) -> int:
    from hpctrain.train.entry import train_command

    return train_command(_request(args))


def _config(args: argparse.Namespace) -> int:
    from hpctrain.config.describe import describe_keys
    from hpctrain.config.load import config_to_toml
    from hpctrain.train.entry import resolve

    cls, cfg = resolve(args.experiment, args.config_file, tuple(args.overrides))
    print(describe_keys(cfg) if args.describe else config_to_toml(cfg), end="")
    return 0


def _plan(args: argparse.Namespace) -> int:
    from hpctrain.perf.plan_command import PlanRequest, plan_command

    return plan_command(PlanRequest(args.experiment, args.config_file, tuple(args.overrides), args.nodes,
                                    args.gpus_per_node, args.busbw, args.preflight, args.steps, args.json))


def _experiments(args: argparse.Namespace) -> int:
    from hpctrain.experiments import list_experiments, resolve_experiment

    names = list_experiments()
    width = max(len(n) for n in names) + 2
    for name in names:
        text = first_sentence(resolve_experiment(name).__doc__ or "")
        lines = textwrap.wrap(text, 118 - width) or [""]
        print(f"{name:{width}s}{lines[0]}" + "".join(f"\n{'':{width}s}{line}" for line in lines[1:]))
    return 0


def first_sentence(doc: str) -> str:
    """A docstring's first sentence, over as many lines as it takes (the first line alone was often half of one)."""
    paragraph = " ".join(doc.strip().split("\n\n")[0].split())
    end = re.search(r"(?<!e\.g)(?<!i\.e)\.(\s|$)", paragraph)
    return paragraph[:end.start() + 1] if end else paragraph


def _rank_prefix() -> str:
    rank = os.environ.get("RANK") or os.environ.get("SLURM_PROCID")
    return f"[rank {rank}] " if rank not in (None, "0") else ""


def parse(argv: Sequence[str] | None) -> argparse.Namespace:
    # key=value items may stand before or after options; argparse alone would reject
    # those after an option, so leftovers of that form are added to the overrides.
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    stray = [e for e in extra if e.startswith("-") or "=" not in e or not hasattr(args, "overrides")]
    if stray:
        parser.error(f"unrecognized arguments: {' '.join(stray)}")
    if extra:
        args.overrides = list(args.overrides) + extra
    return args


def entry_point() -> NoReturn:
    """The `hpctrain` program (console script and python -m hpctrain): main(), then an exit that skips the
    interpreter's finalization, where torch's threads can abort a finished process (see process_exit)."""
    run_and_exit(main)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse(argv)
    from hpctrain.dist.env import agent_pid, under_hpctrain_agent

    if agent_pid():
        from hpctrain.dist.parent_death import stop_with_launcher

        stop_with_launcher(agent_pid())
    try:
        check_torch()
        return args.func(args)
    except UserError as err:
        if args.debug:
            raise
        print(f"hpctrain: error: {_rank_prefix()}{err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        if not under_hpctrain_agent():  # a worker's launcher says it once for all of them
            print("hpctrain: interrupted", file=sys.stderr)
        return 130
