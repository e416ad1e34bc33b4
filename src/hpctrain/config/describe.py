"""`hpctrain config EXP --describe`: every key with its type, current value and docstring."""

from __future__ import annotations

import dataclasses
import sys
import typing
from typing import Iterator

from hpctrain.config.load import _describe, section_classes
from hpctrain.config.schema import RunConfig, field_docs


def toml_value(value: object) -> str:
    """The value as a TOML file or a key=value override writes it (false, "auto", [1, 2]), not Python's repr."""
    import tomli_w

    if value is None:
        return '""'
    if isinstance(value, (tuple, list)):  # on one line: tomli_w writes an array one item a line
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    return tomli_w.dumps({"v": value}).split("=", 1)[1].strip()


def _keys(cfg: RunConfig) -> Iterator[tuple[str, list[tuple[str, str, str, str]]]]:
    """Each section in order, with (key, value as TOML writes it, type in words, docstring) of each field."""
    for section, cls in section_classes(type(cfg.model)).items():
        hints = typing.get_type_hints(cls)
        docs = field_docs(cls)
        yield section, [(f"{section}.{f.name}", toml_value(getattr(getattr(cfg, section), f.name)),
                         _describe(hints[f.name], f"{section}.{f.name}"), docs.get(f.name, ""))
                        for f in dataclasses.fields(cls)]


def describe_keys(cfg: RunConfig) -> str:
    lines = []
    for section, keys in _keys(cfg):
        lines.append(f"[{section}]")
        for key, value, kind, doc in keys:
            lines.append(f"  {key} = {value}  ({kind})")
            lines.append(f"      {doc}")
        lines.append("")
    return "\n".join(lines)


REGENERATE = ".venv/bin/python -m hpctrain.config.describe --markdown > docs/config-reference.md"
"""The command that writes docs/config-reference.md; tests/unit/test_docs.py checks the file against it."""


def reference_markdown() -> str:
    """docs/config-reference.md: every key of every section with its default, type and docstring, in Markdown."""
    lines = ["# Configuration reference", "",
             f"Generated from the schema's field docstrings (`src/hpctrain/config/schema.py`) by `{REGENERATE}`;",
             "do not edit by hand. The defaults are hpctrain's own: an experiment may set others (its `defaults`),",
             "and `hpctrain config EXPERIMENT --describe` shows the values one experiment resolves to, with its",
             "`[model]` keys. How settings are combined: [configuration.md](configuration.md).", ""]
    for section, keys in _keys(RunConfig(experiment="EXPERIMENT")):
        if not keys:
            continue
        lines += [f"## [{section}]", ""]
        for key, value, kind, doc in keys:
            lines.append(f"- **`{key}`** = `{value}` ({kind}). {_escape(doc)}")
        lines.append("")
    return "\n".join(lines)


def _escape(doc: str) -> str:
    """A docstring on one Markdown line: its own line breaks joined, and <...> shown, not read as HTML."""
    return " ".join(doc.split()).replace("<", "&lt;").replace(">", "&gt;")


if __name__ == "__main__":
    if sys.argv[1:] != ["--markdown"]:
        sys.exit(f"usage: {REGENERATE}")
    print(reference_markdown(), end="")
