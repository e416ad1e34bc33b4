"""The command layer: one module per `hpctrain` command, each holding its argparse arguments
(`add_parser(subparsers)`) and its run (`run(args) -> int`, set as the parser's ``run`` default). cli.py builds
the parser from them and dispatches; nothing below this layer imports it.
"""
