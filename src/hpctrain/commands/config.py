"""`hpctrain config EXPERIMENT`: the resolved config as TOML, or --describe every key."""

from __future__ import annotations

import argparse

from hpctrain.commands.arguments import add_run_args


def add_parser(sub) -> None:
    config = sub.add_parser("config", help="print the resolved config as TOML, or --describe every key")
    add_run_args(config)
    config.add_argument("--describe", action="store_true", help="list every key with its type, default and meaning")
    config.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from hpctrain.config.describe import describe_keys
    from hpctrain.config.load import config_to_toml
    from hpctrain.resolution import resolve_config

    _, cfg = resolve_config(args.experiment, args.config_file, tuple(args.overrides))
    print(describe_keys(cfg) if args.describe else config_to_toml(cfg), end="")
    return 0
