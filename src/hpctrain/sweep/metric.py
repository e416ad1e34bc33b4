"""What a sweep compares its points by: an experiment's main validation metric (its class says which and whether
higher is better), or for a script's sweep the metric the user named, read from the point's metrics.jsonl (the
script's own records, or those of hpctrain.session()) or from the lines of its log that a regular expression
matches (--metric-line). Pure functions over records and log text; status.py finds the files."""

from __future__ import annotations

import re
from dataclasses import dataclass

from hpctrain.config.target import is_script
from hpctrain.errors import UserError
from hpctrain.metrics.records import metric_values


@dataclass(frozen=True, kw_only=True)
class MetricSource:
    """Where a sweep's points' metric comes from."""

    name: str
    """The metric's name (a key of metrics.jsonl's records; the table's label for a log line's)."""
    higher_is_better: bool
    """Whether a larger value is better (accuracy) or a smaller one (a loss)."""
    line: str = ""
    """A regular expression over the point's log ('' to read metrics.jsonl): group 'value' or the first group is
    the number, group 'step' (if any) its step; else the matches are counted 1, 2, ..."""
    validation_only: bool = True
    """Only validation records count (an experiment's); a script's records of any split count where it wrote no
    validation ones."""


def metric_source(plan) -> MetricSource:
    """The sweep's source: an experiment's class's main_metric, or a script's sweep's --metric/--metric-line."""
    if is_script(plan.experiment):
        return MetricSource(name=plan.metric or "loss", higher_is_better=plan.higher_is_better,
                            line=plan.metric_line, validation_only=False)
    from hpctrain.experiments import resolve_experiment

    cls = resolve_experiment(plan.experiment)
    return MetricSource(name=cls.main_metric, higher_is_better=cls.higher_is_better)


def check_metric_line(pattern: str) -> None:
    """A UserError for a --metric-line that does not compile or captures no number."""
    try:
        compiled = re.compile(pattern)
    except re.error as err:
        raise UserError(f"--metric-line {pattern!r} is no regular expression: {err}",
                        "e.g. --metric-line 'val_loss=([0-9.eE+-]+)' (the first group is the number).") from None
    if compiled.groups == 0:
        raise UserError(f"--metric-line {pattern!r} has no group to capture the number",
                        "put the number in parentheses, e.g. 'val_loss=([0-9.eE+-]+)', or name it (?P<value>...).")


def curve_from_records(records: list[dict], source: MetricSource) -> list[tuple[int, float]]:
    """(step, value) of every record that has the metric: validation records first; for a script, its records of
    any split when it wrote no validation ones."""
    have = [r for r in records if source.name in metric_values(r)]
    val = [r for r in have if r["split"] == "val"]
    chosen = val if val or source.validation_only else [r for r in have if r["split"] not in ("stop", "resume")]
    return [(r["step"], metric_values(r)[source.name]) for r in chosen]


def curve_from_log(text: str, pattern: str) -> list[tuple[int, float]]:
    """(step, value) of every match of ``pattern`` in ``text``, in order (steps counted from 1 without a 'step'
    group); a match whose number does not read as one is skipped."""
    compiled = re.compile(pattern)
    out: list[tuple[int, float]] = []
    for m in compiled.finditer(text):
        named = m.groupdict()
        try:
            value = float(named["value"] if named.get("value") is not None else m.group(1))
            step = int(named["step"]) if named.get("step") is not None else len(out) + 1
        except (TypeError, ValueError):
            continue
        out.append((step, value))
    return out
