"""`hpctrain config EXP --describe`: every key with its type, current value and docstring."""

from __future__ import annotations

import dataclasses
import typing

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


def describe_keys(cfg: RunConfig) -> str:
    lines = []
    for section, cls in section_classes(type(cfg.model)).items():
        hints = typing.get_type_hints(cls)
        docs = field_docs(cls)
        lines.append(f"[{section}]")
        for f in dataclasses.fields(cls):
            value = getattr(getattr(cfg, section), f.name)
            key = f"{section}.{f.name}"
            lines.append(f"  {key} = {toml_value(value)}  ({_describe(hints[f.name], key)})")
            lines.append(f"      {docs.get(f.name, '')}")
        lines.append("")
    return "\n".join(lines)
