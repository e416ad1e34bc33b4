"""Config sources, lowest to highest: defaults < experiment defaults < TOML file < key=value overrides.

Strict: an unknown section or key, a value of the wrong type or outside its
choices is an error that names the key and suggests the closest valid one. We
do not use a dataclass-to-CLI library (tyro, simple-parsing) because the CLI
form users asked for is ``key=value`` after the positional experiment name,
TOML-compatible, with the same error text for the file and the command line.
"""

from __future__ import annotations

import dataclasses
import shlex
import sys
import typing
from pathlib import Path
from typing import Any, Literal, Mapping

import tomli_w

from hpctrain.config.examples import list_example
from hpctrain.config.schema import SECTIONS, RunConfig
from hpctrain.config.validate import ConfigError
from hpctrain.errors import UserError, did_you_mean

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

DESCRIBE_HINT = "run 'hpctrain config EXPERIMENT --describe' to list every key with its meaning."


@dataclasses.dataclass(frozen=True)
class _Value:
    value: Any
    source: str  # "command line", a file path, or "experiment defaults"
    raw: str | None = None  # the text as typed on the command line


def section_classes(model_class: type) -> dict[str, type]:
    return {**SECTIONS, "model": model_class}


def valid_keys(model_class: type) -> list[str]:
    return [
        f"{name}.{f.name}"
        for name, cls in section_classes(model_class).items()
        for f in dataclasses.fields(cls)
    ]


def load_config(
    experiment: str,
    model_class: type,
    *,
    experiment_defaults: Mapping[str, Any] | None = None,
    config_file: str | Path | None = None,
    overrides: list[str] | tuple[str, ...] = (),
    launch_settings: str | Path | None = None,
) -> RunConfig:
    """Build the frozen RunConfig from all sources; raises UserError on any bad input. ``launch_settings``: a TOML
    file above all of them, the settings hpctrain's command line gave a script it launched (hpctrain.session)."""
    values: dict[str, _Value] = {}
    for key, value in (experiment_defaults or {}).items():
        values[key] = _Value(value, "experiment defaults")
    if config_file is not None:
        values.update(_read_toml(Path(config_file), experiment))
    for item in overrides:
        key, raw = _split_override(item)
        values[key] = _Value(None, "command line", raw)
    if launch_settings is not None:
        values.update(_read_toml(Path(launch_settings), experiment))
    return _build(experiment, model_class, values)


def _split_override(item: str) -> tuple[str, str]:
    key, sep, raw = item.partition("=")
    if not sep or not key.strip():
        raise UserError(
            f"cannot read the override '{item}': expected key=value",
            "write overrides as section.key=value, e.g. train.max_steps=200.",
        )
    return key.strip(), raw.strip()


def _read_toml(path: Path, experiment: str) -> dict[str, _Value]:
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise UserError(f"config file '{path}' does not exist", "check the path given to --config.") from None
    except OSError as err:
        raise UserError(f"cannot read config file '{path}': {err.strerror}", "check its permissions.") from None
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as err:
        raise UserError(f"config file '{path}' is not valid TOML: {err}", "fix the line named above.") from None
    file_experiment = data.pop("experiment", None)
    if file_experiment is not None and file_experiment != experiment:
        raise UserError(
            f"config file '{path}' is for experiment '{file_experiment}', not '{experiment}'",
            f"run {shlex.join(['hpctrain', 'train', str(file_experiment), '--config', str(path)])}, or use a config "
            f"written for '{experiment}'.",
        )
    values: dict[str, _Value] = {}
    for section, table in data.items():
        if not isinstance(table, dict):
            raise ConfigError(
                f"config file '{path}': top-level key '{section}' must be a [section] table",
                "put keys under a section header such as [train].",
            )
        for key, value in table.items():
            values[f"{section}.{key}"] = _Value(value, str(path))
    return values


def _build(experiment: str, model_class: type, values: dict[str, _Value]) -> RunConfig:
    classes = section_classes(model_class)
    keys = valid_keys(model_class)
    per_section: dict[str, dict[str, Any]] = {name: {} for name in classes}
    for dotted, item in values.items():
        section, _, name = dotted.partition(".")
        if section not in classes:
            raise ConfigError(
                f"unknown config section '{section}' in '{dotted}' (from {item.source}).{did_you_mean(section, classes)}",
                DESCRIBE_HINT,
            )
        hints = typing.get_type_hints(classes[section])
        if name not in hints or name not in {f.name for f in dataclasses.fields(classes[section])}:
            raise ConfigError(
                f"unknown config key '{dotted}' (from {item.source}).{did_you_mean(dotted, keys)}", DESCRIBE_HINT
            )
        per_section[section][name] = _coerce(dotted, hints[name], item)
    sections = {name: cls(**per_section[name]) for name, cls in classes.items()}
    return RunConfig(experiment=experiment, **sections)


def _coerce(key: str, typ: Any, item: _Value) -> Any:
    value = item.value
    if item.raw is not None:
        value = _parse_raw(item.raw, typ)
    ok, converted = _check(typ, value)
    if not ok:
        shown = item.raw if item.raw is not None else repr(value)
        raise ConfigError(
            f"config key '{key}' expects {_describe(typ, key)}, got {shown} (from {item.source})",
            DESCRIBE_HINT,
        )
    return converted


def _parse_raw(raw: str, typ: Any) -> Any:
    """Command-line text to a value: strings stay as typed, the rest is read as a TOML value."""
    if typ is str or (typing.get_origin(typ) is Literal and all(isinstance(a, str) for a in typing.get_args(typ))):
        return raw
    try:
        return tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        return raw  # _check rejects it with the expected type in the message


def _check(typ: Any, value: Any) -> tuple[bool, Any]:
    origin = typing.get_origin(typ)
    if origin is Literal:  # by type too: 1 == True, but 1 is not a valid true/false/'auto'
        return any(type(value) is type(a) and value == a for a in typing.get_args(typ)), value
    if typ is bool:
        return isinstance(value, bool), value
    if typ is int:
        return isinstance(value, int) and not isinstance(value, bool), value
    if typ is float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        return ok, float(value) if ok else value
    if typ is str:
        return isinstance(value, str), value
    if origin is tuple:
        args = typing.get_args(typ)
        if len(args) == 2 and args[1] is Ellipsis:  # tuple[X, ...]: any length
            args = (args[0],) * len(value) if isinstance(value, (list, tuple)) else ()
        if not isinstance(value, (list, tuple)) or len(value) != len(args):
            return False, value
        checked = [_check(a, v) for a, v in zip(args, value)]
        return all(ok for ok, _ in checked), tuple(v for _, v in checked)
    raise TypeError(f"unsupported config field type {typ!r}")  # a schema bug, not user input


def _describe(typ: Any, key: str = "") -> str:
    origin = typing.get_origin(typ)
    if origin is Literal:  # as TOML spells them: true, not True
        return "one of " + ", ".join(_toml_literal(a) for a in typing.get_args(typ))
    if origin is tuple:
        return list_example(key, typ)
    return {bool: "true or false", int: "an integer", float: "a number", str: "a string"}[typ]


def _toml_literal(value: Any) -> str:
    return ("true" if value else "false") if isinstance(value, bool) else repr(value)


def config_to_dict(cfg: RunConfig) -> dict[str, Any]:
    out: dict[str, Any] = {"experiment": cfg.experiment}
    for f in dataclasses.fields(cfg):
        if f.name == "experiment":
            continue
        section = dataclasses.asdict(getattr(cfg, f.name))
        out[f.name] = {k: list(v) if isinstance(v, tuple) else v for k, v in section.items()}
    return out


def flat_config(cfg: RunConfig) -> dict[str, Any]:
    """The resolved config as dotted keys (train.global_batch_size, model.width, ...): the experiment trackers'
    parameters."""
    return _flatten(config_to_dict(cfg))


def config_to_toml(cfg: RunConfig) -> str:
    """The resolved config as TOML; ``load_config(..., config_file=...)`` reads it back to an equal RunConfig."""
    return tomli_w.dumps(config_to_dict(cfg))


def given_keys(experiment: str, config_file: str | Path | None = None,
               overrides: list[str] | tuple[str, ...] = ()) -> list[str]:
    """The dotted keys that a --config file and key=value overrides set, file first, each once: what the user gave,
    as load_config reads it (an unreadable file or a malformed override is the same UserError)."""
    keys = list(_read_toml(Path(config_file), experiment)) if config_file is not None else []
    keys += [_split_override(item)[0] for item in overrides]
    return list(dict.fromkeys(keys))


def settings_toml(cfg: RunConfig, keys: list[str] | tuple[str, ...]) -> str:
    """The settings a user gave, as TOML: the top-level experiment, then each of ``keys`` with its resolved value
    from ``cfg`` (typed and validated), and run.dir always, absolute. What a script job's processes read
    (HPCTRAIN_SETTINGS): only these, so that code reading it puts its own defaults below them, not hpctrain's."""
    resolved = config_to_dict(cfg)
    out: dict[str, Any] = {"experiment": cfg.experiment}
    for key in (*keys, "run.dir"):
        section, _, name = key.partition(".")
        out.setdefault(section, {})[name] = resolved[section][name]
    out["run"]["dir"] = str(Path(cfg.run_dir).resolve())
    return tomli_w.dumps(out)


def flat_differences(old_text: str, new_text: str) -> list[tuple[str, Any, Any]]:
    """(dotted key, old value, new value) for every key whose value differs between two resolved configs (TOML
    text; a key missing on one side shows as None there). Unreadable text gives no differences."""
    try:
        old, new = _flatten(tomllib.loads(old_text)), _flatten(tomllib.loads(new_text))
    except tomllib.TOMLDecodeError:
        return []
    return [(key, old.get(key), new.get(key)) for key in sorted(set(old) | set(new)) if old.get(key) != new.get(key)]


def _flatten(tree: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in tree.items():
        if isinstance(value, Mapping):
            out.update(_flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out
