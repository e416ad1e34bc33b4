"""A script job's part of the sbatch script (--script, --module: the user's own torchrun script): its program and
arguments, the settings it is given, who signals its ranks, and the batch shell's requeue after the step, when
every node's launcher recorded that all its ranks exited with a requeue code (slurm/exits.py). Pure functions of
the job spec, for render.render_script (golden-tested with it)."""

from __future__ import annotations

import shlex
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # render imports this module
    from hpctrain.slurm.render import JobSpec

CONFIG_DELIMITER = "HPCTRAIN_CONFIG_EOF"
"""The heredoc delimiter of the resolved config in a job script (an experiment's and a script's)."""
SETTINGS_DELIMITER = "HPCTRAIN_SETTINGS_EOF"
q = shlex.quote


@dataclass(frozen=True, kw_only=True)
class ScriptSpec:
    """A script job's program (--script, --module): each node's torchrun runs it instead of hpctrain."""

    program: tuple[str, ...]
    """What follows torchrun's arguments: (PATH,) or ("-m", MODULE), relative paths from the job's workdir."""
    args: tuple[str, ...] = ()
    """The script's arguments (after --), passed verbatim. A sweep's array: point_args instead."""
    point_args: tuple[tuple[str, ...], ...] = ()
    """A sweep's array: each point's arguments, in array-index order."""
    settings_toml: str = ""
    """The settings the user gave, written to RUN_DIR/settings.toml (HPCTRAIN_SETTINGS) by the job. A sweep's
    array: '' (copied from SWEEP_DIR/settings/POINT.toml)."""
    requeue_codes: tuple[int, ...] = (75,)
    """Exit codes with which the script asks to be requeued (fault.exit_code first, then fault.requeue_exit_codes)."""
    requeue: bool = True
    """fault.requeue: the batch shell requeues the job when every node's ranks asked for it."""


def script_config(spec: JobSpec) -> str:
    """The resolved config (RUN_DIR/config.toml too: status and report read it) and the settings the user gave
    (RUN_DIR/settings.toml, HPCTRAIN_SETTINGS for every rank), fixed at render time or, in an array, by the sweep."""
    replace = ['mv -f "$CONFIG.tmp" "$CONFIG"', 'cp "$CONFIG" "$RUN_DIR/config.toml.tmp"',
               'mv -f "$RUN_DIR/config.toml.tmp" "$RUN_DIR/config.toml"']
    if spec.array is not None:
        lines = ["", "# --- the point's resolved config and settings, written by 'hpctrain sweep submit' ---",
                 'CONFIG="$RUN_DIR/slurm/config_$SLURM_JOB_ID.toml"', 'cp "$SWEEP_DIR/configs/$POINT.toml" "$CONFIG.tmp"',
                 *replace, 'cp "$SWEEP_DIR/settings/$POINT.toml" "$RUN_DIR/settings.toml.tmp"']
    else:
        lines = ["", "# --- the resolved config and the settings you gave, fixed at render time (a requeued job runs the "
                 "same) ---", 'CONFIG="$RUN_DIR/slurm/config_$SLURM_JOB_ID.toml"',
                 f"cat > \"$CONFIG.tmp\" <<'{CONFIG_DELIMITER}'", spec.config_toml.rstrip("\n"), CONFIG_DELIMITER,
                 *replace, f"cat > \"$RUN_DIR/settings.toml.tmp\" <<'{SETTINGS_DELIMITER}'",
                 spec.script.settings_toml.rstrip("\n"), SETTINGS_DELIMITER]
    return "\n".join(lines + [
        'mv -f "$RUN_DIR/settings.toml.tmp" "$RUN_DIR/settings.toml"',
        "# every rank finds the settings there (hpctrain.session() reads them)",
        'export HPCTRAIN_SETTINGS="$RUN_DIR/settings.toml"',
    ])


def script_signals(spec: JobSpec) -> str:
    """Who signals the script's ranks, and where each node records how they ended ('' for an experiment)."""
    if spec.script is None:
        return ""
    job = '"${SLURM_ARRAY_JOB_ID}_${SLURM_ARRAY_TASK_ID}"' if spec.array is not None else '"$SLURM_JOB_ID"'
    return "\n".join([
        "",
        "# --- signals: Slurm signals every process of the job step itself with ProctrackType cgroup or linuxproc",
        "# (pgid: only each task's process group), the script's ranks included; the node launchers then pass none on,",
        "# or each rank would get every signal twice ---",
        "case \"$(scontrol show config 2> /dev/null | sed -n 's/^ProctrackType *= *//p')\" in",
        "  proctrack/cgroup|proctrack/linuxproc) export HPCTRAIN_FORWARD_SIGNALS=0 ;;",
        "  *) export HPCTRAIN_FORWARD_SIGNALS=1 ;;",
        "esac",
        "# what 'scontrol requeue' takes (a sweep's point: its own array task, never the whole array)",
        f"REQUEUE_ID={job}",
        "# each node's launcher records how its ranks ended here, one file per node (hpctrain/slurm/exits.py)",
        'export HPCTRAIN_EXITS_DIR="$RUN_DIR/slurm/exits/$REQUEUE_ID.${SLURM_RESTART_COUNT:-0}"',
        'mkdir -p "$HPCTRAIN_EXITS_DIR"',
        'rm -f "$HPCTRAIN_EXITS_DIR"/node*',
    ])


def script_arguments(spec: JobSpec) -> list[str]:
    """The script's arguments as shell words: its own, or in an array the point's (SCRIPT_ARGS, point_arguments);
    the ${X[@]+...} form because bash before 4.4 calls an empty array unbound under set -u."""
    if spec.array is not None:
        return ['${SCRIPT_ARGS[@]+"${SCRIPT_ARGS[@]}"}']
    return [q(a) for a in spec.script.args]


def point_arguments(spec: JobSpec) -> list[str]:
    """In a script job's array, SCRIPT_ARGS: the task's point's arguments ([] otherwise)."""
    if spec.script is None or spec.array is None:
        return []
    lines = ["# this task's point: the script's arguments", "SCRIPT_ARGS=()", 'case "$SLURM_ARRAY_TASK_ID" in']
    lines += [f"  {i}) SCRIPT_ARGS=({' '.join(q(a) for a in args)}) ;;" for i, args in enumerate(spec.script.point_args)]
    return lines + ["esac"]


def script_end(spec: JobSpec) -> list[str]:
    """After the step: the job requeued when every node's ranks all exited with a requeue code (and srun ended
    cleanly: a launcher that recorded a requeue stop exits 0); any other exit is the job's failure, never requeued."""
    codes = " ".join(str(c) for c in spec.script.requeue_codes)
    first = spec.script.requeue_codes[0]
    lines = [
        "# How the script's ranks ended, from each node's record: requeue when every node asked for it (all its",
        "# ranks exited with a requeue code), mixed when only some did; any other exit is a failure, never requeued",
        f'REQUEUE_CODES="{codes}"',
        "script_ended() {",
        "  local f code asked=0",
        '  for f in "$HPCTRAIN_EXITS_DIR"/node*.json; do',
        '    [ -e "$f" ] || continue',
        "    code=$(sed -n 's/^{\"exit_code\": \\(-\\{0,1\\}[0-9]*\\).*/\\1/p' \"$f\")",
        '    case " $REQUEUE_CODES " in *" $code "*) asked=$((asked + 1)) ;; esac',
        "  done",
        '  if [ "$asked" -gt 0 ] && [ "$asked" -eq "$SLURM_JOB_NUM_NODES" ]; then echo requeue',
        '  elif [ "$asked" -gt 0 ]; then echo mixed; fi',
        "}",
        "ended=$(script_ended)",
        f'if [ "$rc" -eq 0 ] && [ "$ended" = requeue ]; then rc={first}; fi',
        'if [ "$rc" -eq 0 ] && [ "$ended" = mixed ]; then',
        '  echo "hpctrain: the ranks of some nodes asked for a requeue, the others did not: a failure"',
        "  rc=1",
        "fi",
        'echo "hpctrain: job step ended with exit code $rc at $(date -Is)"',
    ]
    if spec.script.requeue:
        lines += [
            f'if [ "$ended" = requeue ] && [ "$rc" -eq {first} ]; then',
            '  echo "hpctrain: every rank of the script exited with a requeue code: requeueing job $REQUEUE_ID"',
            '  scontrol requeue "$REQUEUE_ID" || echo "hpctrain: \'scontrol requeue $REQUEUE_ID\' failed; submit the same '
            'run dir again to go on"',
            "fi",
        ]
    return lines + ['exit "$rc"']
