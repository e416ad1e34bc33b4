"""The `hpctrain` command: build the parser from the command modules (hpctrain/commands, one per command, each
with its arguments and its run), dispatch, turn errors into messages. No logic of its own."""

from __future__ import annotations

import argparse
import os
import sys
from typing import NoReturn, Sequence

from hpctrain import __version__
from hpctrain.commands import (check, config, doctor, experiments, export, plan, predict, report, sample, shard,
                               slurm, sweep, synth, train)
from hpctrain.commands.arguments import parse_with_overrides
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
    # The order of `hpctrain --help`; train's module adds train and eval.
    for command in (train, sample, export, predict, config, slurm, sweep, plan, report, shard, synth, doctor, check,
                    experiments):
        command.add_parser(sub)
    return parser


def _rank_prefix() -> str:
    rank = os.environ.get("RANK") or os.environ.get("SLURM_PROCID")
    return f"[rank {rank}] " if rank not in (None, "0") else ""


def parse(argv: Sequence[str] | None) -> argparse.Namespace:
    # key=value items may stand before or after options (commands.arguments.parse_with_overrides).
    return parse_with_overrides(build_parser(), argv)


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
        return args.run(args)
    except UserError as err:
        if args.debug:
            raise
        print(f"hpctrain: error: {_rank_prefix()}{err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        if not under_hpctrain_agent():  # a worker's launcher says it once for all of them
            print("hpctrain: interrupted", file=sys.stderr)
        return 130
