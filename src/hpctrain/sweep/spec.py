"""A sweep on disk: every point's config resolved and checked, then `SWEEP_DIR/sweep.toml` (the base config's
sources, the axes, the points in array order) and `SWEEP_DIR/configs/NAME.toml` (each point's resolved config,
what its array task or local run trains with). A sweep is a list of configs plus an index: nothing in the training
path knows about it. A script's sweep also has each point's settings, `SWEEP_DIR/settings/NAME.toml` (its
HPCTRAIN_SETTINGS), and its script arguments and metric in sweep.toml."""

from __future__ import annotations

import dataclasses
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import tomli_w

from hpctrain.atomic import atomic_write_text
from hpctrain.config.batch import batch_sizes
from hpctrain.config.load import config_to_toml, given_keys, settings_toml
from hpctrain.config.schema import RunConfig
from hpctrain.config.target import is_script
from hpctrain.errors import UserError
from hpctrain.sweep.grid import Axis, Point, grid_points, is_script_axis, parse_axis, script_args_of

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

SWEEP_FILE = "sweep.toml"
RUN_DIR_SLOT = "{run_dir}"
"""In a script's sweep's arguments: the point's run dir."""


@dataclass(frozen=True)
class SweepSpec:
    sweep_dir: Path
    """Absolute sweep directory."""
    experiment: str
    config_file: str
    """The base config file ('' for none), absolute."""
    overrides: tuple[str, ...]
    """key=value settings shared by every point."""
    axes: tuple[Axis, ...]
    points: tuple[Point, ...]
    script_args: tuple[str, ...] = ()
    """A script's sweep: the arguments after -- that every point's script gets (grid.script_args_of adds its own)."""
    metric: str = ""
    """The metric the points are compared by; '' for an experiment's sweep (its class's main_metric)."""
    metric_line: str = ""
    """A script's sweep: a regular expression whose first group (or group 'value') is the metric in the point's log
    (and group 'step' its step, if any); '' to read the metric from the point's metrics.jsonl."""
    higher_is_better: bool = False
    """With metric: whether a larger value is better."""

    def run_dir(self, point: Point) -> Path:
        return self.sweep_dir / point.name

    def config_path(self, point: Point) -> Path:
        return self.sweep_dir / "configs" / f"{point.name}.toml"

    def settings_path(self, point: Point) -> Path:
        """A script's sweep: the point's settings (what the user gave, and its own), its HPCTRAIN_SETTINGS."""
        return self.sweep_dir / "settings" / f"{point.name}.toml"

    def script_args_of(self, point: Point) -> tuple[str, ...]:
        """The point's arguments for the script (grid.script_args_of), {run_dir} in them its own run dir: where a
        script that takes an output folder writes without meeting the other points."""
        own = tuple(a.replace(RUN_DIR_SLOT, str(self.run_dir(point))) for a in self.script_args)
        return script_args_of(own, point.settings)

    def point_overrides(self, point: Point) -> tuple[str, ...]:
        """Every key=value a point's config is resolved from (what its settings file holds, with run.dir)."""
        return (*self.overrides, *point.overrides, f"run.dir={self.run_dir(point)}")


def build_sweep(experiment: str, config_file: str | None, overrides: tuple[str, ...], grid: list[str],
                sweep_dir: str, allow_large: bool = False, **script: Any) -> tuple[SweepSpec, dict[str, RunConfig]]:
    """The plan and every point's resolved config, each checked: a bad value names its point and key. ``script``: a
    script's sweep's SweepSpec fields (script_args, metric, metric_line, higher_is_better)."""
    axes = tuple(parse_axis(g) for g in grid)
    arguments = [a.key for a in axes if is_script_axis(a.key)]
    if arguments and not is_script(experiment):
        raise UserError(f"--grid {arguments[0]}: not a config key (section.key, e.g. optim.lr); a KEY without a dot "
                        "is a script's argument", "sweep a script of your own with --script PATH (its arguments "
                        "after --), or give the experiment's key in full.")
    points = tuple(grid_points(list(axes), allow_large))
    base = [o for o in overrides if not o.partition("=")[0].strip().startswith("run.dir")]
    plan = SweepSpec(Path(sweep_dir).resolve(), experiment, str(Path(config_file).resolve()) if config_file else "",
                     tuple(base), axes, points, **script)
    return plan, {p.name: resolve_point(plan, p) for p in points}


def resolve_point(plan: SweepSpec, point: Point) -> RunConfig:
    from hpctrain.resolution import resolve_settings

    try:
        cfg = resolve_settings(plan.experiment, plan.config_file or None, plan.point_overrides(point))
        s = cfg.slurm
        if cfg.script is None:  # a script's batches are its own
            batch_sizes(cfg.train.global_batch_size, cfg.train.micro_batch_size, s.nodes * s.gpus_per_node)
    except UserError as err:
        where = ", ".join(f"{k}={v}" for k, v in point.settings)
        raise type(err)(f"sweep point {point.name} ({where}): {err.args[0] if err.args else err}", err.hint) from None
    return grouped(cfg, plan.sweep_dir)


def grouped(cfg: RunConfig, sweep_dir: Path) -> RunConfig:
    """A point with experiment trackers: its tracker run in the sweep's group (log.tracker_group, unless set), and
    with MLflow's default file store the sweep's one (SWEEP_DIR/mlruns), so the points are seen side by side. A
    point without trackers is left as it is (its config, so an older sweep's, stays the same)."""
    log = cfg.log
    if not log.trackers:
        return cfg
    changes = {"tracker_group": log.tracker_group or sweep_dir.name}
    if "mlflow" in log.trackers and not log.mlflow_uri:
        changes["mlflow_uri"] = (sweep_dir / "mlruns").as_uri()
    return dataclasses.replace(cfg, log=dataclasses.replace(log, **changes))


def point_settings(plan: SweepSpec, point: Point, cfg: RunConfig) -> str:
    """A script's point's settings file: the keys the base config file, the shared settings and the point's own
    axes set, resolved (config/load.settings_toml)."""
    keys = given_keys(plan.experiment, plan.config_file or None, plan.point_overrides(point))
    return settings_toml(cfg, keys)


def write_sweep(plan: SweepSpec, configs: dict[str, RunConfig]) -> None:
    """sweep.toml and configs/; a sweep dir that holds another sweep is refused (nothing is overwritten)."""
    check_same_sweep(plan, configs)
    (plan.sweep_dir / "configs").mkdir(parents=True, exist_ok=True)
    if is_script(plan.experiment):
        (plan.sweep_dir / "settings").mkdir(exist_ok=True)
    for point in plan.points:
        if not plan.config_path(point).exists():
            atomic_write_text(plan.config_path(point), config_to_toml(configs[point.name]))
        if is_script(plan.experiment) and not plan.settings_path(point).exists():
            atomic_write_text(plan.settings_path(point), point_settings(plan, point, configs[point.name]))
    path = plan.sweep_dir / SWEEP_FILE
    if not path.exists():
        atomic_write_text(path, tomli_w.dumps(_to_dict(plan)))


def check_same_sweep(plan: SweepSpec, configs: dict[str, RunConfig]) -> None:
    """Going on with the sweep in plan.sweep_dir is only going on with the same grid and settings, finished or not
    (a finished dir given another grid would otherwise report its old points done and never run the new ones)."""
    path = plan.sweep_dir / SWEEP_FILE
    if path.exists():
        differs = what_differs(read_plan(plan.sweep_dir), plan)
        if differs:
            raise UserError(f"{plan.sweep_dir} already holds another sweep ({SWEEP_FILE} differs: {differs})",
                            f"a sweep dir keeps its grid and settings (its points were trained with them): submit "
                            f"this grid as a new sweep with another --dir (e.g. --dir {plan.sweep_dir}-2), or repeat "
                            f"that sweep's own command to go on with it.")
    changed = [p.name for p in plan.points if plan.config_path(p).exists() and plan.config_path(p).read_text() !=
               config_to_toml(configs[p.name])]
    if changed:  # the same command, but what it resolves to moved (an edited --config file): not the same sweep
        raise UserError(f"{plan.sweep_dir}: the resolved config of {len(changed)} point(s) changed since the sweep was "
                        f"written (e.g. {changed[0]}: configs/{changed[0]}.toml differs; an edited --config file?)",
                        "a sweep's points keep their configs (their checkpoints were trained with them): submit the "
                        "changed settings as a new sweep with another --dir.")


def what_differs(old: SweepSpec, new: SweepSpec) -> str:
    """What the sweep on disk (old) and the one asked for (new) disagree on, each as 'before, now ...'; '' when
    they are the same sweep."""
    def axes(p: SweepSpec) -> str:
        return " ".join(f"--grid {a.key}={','.join(a.values)}" for a in p.axes)

    def settings(p: SweepSpec) -> str:
        return " ".join(p.overrides) or "none"

    parts = [(name, get(old), get(new)) for name, get in (
        ("experiment", lambda p: p.experiment), ("config file", lambda p: p.config_file or "none"),
        ("axes", axes), ("shared settings", settings), ("script arguments", lambda p: shlex.join(p.script_args)),
        ("metric", lambda p: f"{p.metric} {p.metric_line} {p.higher_is_better}"))]
    named = [p.name for p in old.points] != [p.name for p in new.points]  # the same axes: only another version's names
    return "; ".join(f"{name} {was}, now {now}" for name, was, now in parts if was != now) or (
        "its points' names (written by another hpctrain version?)" if named else "")


def _to_dict(plan: SweepSpec) -> dict:
    script = {"script_args": list(plan.script_args), "metric": plan.metric, "metric_line": plan.metric_line,
              "higher_is_better": plan.higher_is_better} if is_script(plan.experiment) else {}
    return {
        "experiment": plan.experiment, "config_file": plan.config_file, "overrides": list(plan.overrides), **script,
        "axes": [{"key": a.key, "values": list(a.values)} for a in plan.axes],
        "points": [{"index": p.index, "name": p.name, "settings": [list(kv) for kv in p.settings]}
                   for p in plan.points],
    }


def read_plan(sweep_dir: Path) -> SweepSpec:
    path = Path(sweep_dir) / SWEEP_FILE
    if not path.is_file():
        raise UserError(f"{sweep_dir} is not a sweep directory (no {SWEEP_FILE})",
                        "pass the --dir given to 'hpctrain sweep submit'.")
    try:
        data = tomllib.loads(path.read_text())
        axes = tuple(Axis(a["key"], tuple(a["values"])) for a in data["axes"])
        points = tuple(Point(p["index"], p["name"], tuple((k, v) for k, v in p["settings"])) for p in data["points"])
        return SweepSpec(Path(sweep_dir).resolve(), data["experiment"], data["config_file"],
                         tuple(data["overrides"]), axes, points, script_args=tuple(data.get("script_args", ())),
                         metric=data.get("metric", ""), metric_line=data.get("metric_line", ""),
                         higher_is_better=bool(data.get("higher_is_better", False)))
    except (tomllib.TOMLDecodeError, KeyError, TypeError, ValueError) as err:
        raise UserError(f"{path} is damaged ({type(err).__name__}: {err})",
                        "it is written by 'hpctrain sweep submit'; submit the sweep again into a new --dir.") from None
