"""`hpctrain experiments`: the built-in experiments, each with its docstring's first sentence."""

from __future__ import annotations

import argparse
import re
import textwrap


def add_parser(sub) -> None:
    experiments = sub.add_parser("experiments", help="list the built-in experiments")
    experiments.add_argument("--debug", action="store_true", help=argparse.SUPPRESS)
    experiments.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
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
