"""The sbatch script, as a pure function of a :class:`JobSpec` (golden-tested).

The pattern of the HPC guides (one torchrun per node, MASTER_ADDR from the node list, c10d rendezvous), plus what
they leave out and users get wrong (render_script lists them, with the reasons): one failed node ends the job,
srun gets --cpus-per-task itself, no node rank from the batch shell, a rendezvous port per job, the warning signal
passed on to every task, and a requeued job that keeps its first log and its own config.

Two launchers (slurm.launcher): ``torchrun`` (default), one task per node running ``hpctrain.launch``; ``srun``,
one task per process running ``python -m hpctrain.slurm.task``. render_script says what each does on a failure.
A script job (:class:`ScriptSpec`: the user's own torchrun script) runs torchrun per node over the script instead of
hpctrain, and its batch shell requeues the job when every rank asked for it (slurm/script_job.py).

Every user value is quoted: for the shell with :func:`shlex.quote`, and on ``#SBATCH`` lines in sbatch's own
double-quote syntax. Config values cannot hold newlines (the config rejects control characters), so nothing can end
a line early; a script's arguments may, and stay single-quoted words (a quoted newline ends no command).
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass

from hpctrain.config.schema import SlurmSection
from hpctrain.dist.env import PORT_BASE, PORT_SPAN
from hpctrain.slurm.script_job import (CONFIG_DELIMITER, ScriptSpec, point_arguments, script_arguments, script_config,
                                       script_end, script_signals)



@dataclass(frozen=True, kw_only=True)
class ArraySpec:
    """A sweep's job array (hpctrain.sweep): task i trains point i, each point a run dir of its own."""

    sweep_dir: str
    """Absolute sweep directory: the points' run dirs, their configs (configs/NAME.toml) and the array's logs."""
    points: tuple[str, ...]
    """The points' names, in array-index order (each also its run dir's name in the sweep dir)."""
    max_parallel: int = 0
    """At most this many tasks at once (sbatch --array=...%K); 0: as many as the cluster runs."""
    indices: tuple[int, ...] = ()
    """The points this array runs (a sweep submitted again: the unfinished ones); empty: all of them."""


@dataclass(frozen=True, kw_only=True)
class JobSpec:
    """Everything the script depends on; built by :func:`hpctrain.slurm.job.job_spec`."""

    slurm: SlurmSection
    """The [slurm] section."""
    job_name: str
    """Resolved job name (slurm.job_name or the run name)."""
    experiment: str
    """Experiment name or module:Class, as given."""
    config_toml: str
    """The resolved config, embedded in the script and written to the run dir by the job."""
    run_dir: str
    """Absolute run directory (must be visible from every node)."""
    workdir: str
    """Absolute directory the job runs in (where 'module:Class' experiments are importable from)."""
    python: str
    """Interpreter on the nodes."""
    venv: str
    """Virtual environment to activate ('' for none)."""
    warning_signal: str
    """fault.warning_signal, e.g. SIGUSR2, or 'none'."""
    version: str
    """hpctrain version, for the header."""
    array: ArraySpec | None = None
    """A sweep's job array: the run dir and config come from the task's point. None: one run."""
    script: ScriptSpec | None = None
    """A script job's program; None: the experiment, trained by hpctrain."""
    nproc_per_node: int = 0
    """torchrun's --nproc-per-node when the command line gave one (--nproc-per-node); 0: slurm.gpus_per_node. The
    lint requires the two to agree (one process per GPU)."""


def sbatch_quote(value: str) -> str:
    """A value for an ``#SBATCH`` line: sbatch splits at spaces, honours double quotes and backslashes."""
    if value and all(c.isalnum() or c in "-_.:/%@=+," for c in value):
        return value
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'


def q(value: str) -> str:
    return shlex.quote(str(value))


def cpus_per_task(s: SlurmSection) -> int:
    """CPUs per node for the training (slurm.cpus_per_task, whatever the launcher)."""
    return s.cpus_per_task or 8 * s.gpus_per_node


def tasks_per_node(s: SlurmSection) -> int:
    """Slurm tasks per node: one torchrun, or (srun) one per process."""
    return s.gpus_per_node if s.launcher == "srun" else 1


def task_cpus(s: SlurmSection) -> int:
    """--cpus-per-task: the node's CPUs, or (srun) each task's equal share of them (lint warns about a remainder)."""
    return max(1, cpus_per_task(s) // tasks_per_node(s))


def gpu_binding(s: SlurmSection) -> list[str]:
    """srun's GPU binding option for srun-launched tasks ([] for none).

    ``--gpu-bind=per_task:1`` and no GPU request on the step: the step inherits the job's GPUs on each node
    (``#SBATCH --gres=gpu[:TYPE]:G``, as in torchrun mode) and Slurm hands them out in order, one per task
    (CUDA_VISIBLE_DEVICES, and the device cgroup where ConstrainDevices is set). Not ``--gpus-per-task=1``: it
    is a second GPU request beside the job's ``--gres=gpu``, which Slurm handles differently across versions
    (an untyped step request in a typed ``--gres=gpu:a100:G`` job fails with "Step requested GRES (gpu:(null))
    not found in the job" on 23.02; ``--gpus-per-node`` and ``--gres=gpu`` are mutually exclusive, a fatal
    error in current releases; 21.08 changed what --gpus-per-task binds). Not ``--gpu-bind=single:1``: it picks
    by the task's CPU socket affinity (gres.conf Cores), and where that does not match the GPUs slurmstepd
    reports an error and binds the task to the allocation's first GPU, so tasks share one GPU; it also had
    wrong-GPU bugs fixed in 22.05 and 23.02. per_task:1 exists since 21.08 (older releases are out of support)."""
    if s.launcher != "srun" or not s.gpus or s.gpu_bind == "none":
        return []
    return ["--gpu-bind=per_task:1"]


def rendezvous_port(s: SlurmSection) -> str:
    # the shell form of hpctrain.dist.env.job_port
    return str(s.port) if s.port else f"$(( {PORT_BASE} + SLURM_JOB_ID % {PORT_SPAN} ))"


def render_script(spec: JobSpec) -> str:
    """The complete sbatch script.

    What it adds to the guides' pattern: ``set -euo pipefail``; ``srun --kill-on-bad-exit=1`` so one failed node
    ends the job. ``--cpus-per-task`` given to srun explicitly: since Slurm 22.05 srun no longer inherits it from
    sbatch, and the loader workers would share one CPU. No ``--node_rank=$SLURM_NODEID`` (expanded once, in the
    batch shell, it is 0 for every node); the c10d rendezvous assigns ranks. A rendezvous port derived from the job
    id, and ``--standalone`` on one node, so two jobs on one node do not collide. The preemption path of the
    fault-tolerance design: ``--signal=B:SIG@LEAD`` reaches the batch shell, whose trap passes it to srun, which
    passes it to every task; the launcher forwards it to the workers, which save, requeue and exit with
    fault.exit_code. ``--open-mode=append`` so a requeued job keeps its first log; the resolved config is embedded
    (a later edit of the TOML file cannot change a requeued run); the exact launch command is saved in the run dir.

    ``torchrun``: one task per node runs ``hpctrain.launch``, which starts the node's processes, forwards signals to
    them, runs the node monitors, and maps a failure to the first failed worker's exit code and one alert. ``srun``:
    one task per process (``--ntasks-per-node=G`` in sbatch and srun, ``--cpus-per-task`` a G-th of the node's
    CPUs), each running ``python -m hpctrain.slurm.task`` = ``python -m hpctrain`` (plus the node monitors in each
    node's first task); hpctrain reads its rank from SLURM_PROCID/SLURM_LOCALID/SLURM_STEP_NUM_TASKS and meets at
    MASTER_ADDR:MASTER_PORT (tcp://). srun and slurmstepd deliver the signals to every task themselves; a failure
    ends the step through ``--kill-on-bad-exit`` with srun's exit code (the highest of the tasks'), and each rank
    that fails with an error sends its own alert (one killed without a word, e.g. by the OOM killer, sends none:
    there is no launcher to notice)."""
    parts = [
        _header(spec),
        _sbatch_lines(spec),
        _preamble(spec),
        _environment(spec),
        _network(spec),
        _config(spec) if spec.script is None else script_config(spec),
        script_signals(spec),
        _launch(spec),
    ]
    return "\n".join(p for p in parts if p) + "\n"


def _header(spec: JobSpec) -> str:
    what = "--script PATH" if spec.script else "EXPERIMENT"  # (a script's path may be any text: not in a comment)
    tail = " -- SCRIPT ARGS" if spec.script else ""
    again = (f"hpctrain sweep submit {what} --grid KEY=V1,V2 ... --dry-run{tail}" if spec.array
             else f"hpctrain slurm render {what} --config FILE [key=value ...]{tail}")
    kind = "a script job" if spec.script else f"experiment {spec.experiment!r}"
    return (
        "#!/bin/bash\n"
        f"# Written by hpctrain {spec.version} for {kind}.\n"
        "# Change the [slurm] config and render again rather than editing this file:\n"
        f"#   {again}"
    )


def _sbatch_lines(spec: JobSpec) -> str:
    s = spec.slurm
    opts: list[tuple[str, str | None]] = [
        ("--job-name", spec.job_name),
        ("--nodes", str(s.nodes)),
        ("--ntasks-per-node", str(tasks_per_node(s))),
        ("--cpus-per-task", str(task_cpus(s))),
    ]
    if s.gpus:
        opts.append(("--gres", f"gpu:{s.gpu_type + ':' if s.gpu_type else ''}{s.gpus_per_node}"))
    opts += [("--time", s.time)]
    for key, value in (("--partition", s.partition), ("--account", s.account), ("--qos", s.qos),
                       ("--mem", s.mem), ("--constraint", s.constraint)):
        if value:
            opts.append((key, value))
    if s.exclusive:
        opts.append(("--exclusive", None))
    if spec.array is not None:
        n, k, only = len(spec.array.points), spec.array.max_parallel, spec.array.indices
        opts.append(("--array", (",".join(map(str, only)) if only else f"0-{n - 1}") + (f"%{k}" if k else "")))
    output = f"{spec.array.sweep_dir}/logs/%x_%A_%a.out" if spec.array else f"{spec.run_dir}/logs/%x_%j.out"
    opts += [
        ("--output", output),
        ("--open-mode", "append"),
    ]
    opts.append(("--requeue", None) if s.requeue else ("--no-requeue", None))
    if spec.warning_signal != "none" and s.signal_lead_s:
        opts.append(("--signal", f"B:{spec.warning_signal.removeprefix('SIG')}@{s.signal_lead_s}"))
    lines = [f"#SBATCH {k}" if v is None else f"#SBATCH {k}={sbatch_quote(v)}" for k, v in opts]
    lines += [f"#SBATCH {_extra_option(item)}" for item in s.extra_sbatch]
    return "\n".join(lines)


def _extra_option(item: str) -> str:
    key, eq, value = item.partition("=")
    return f"{key}={sbatch_quote(value)}" if eq else sbatch_quote(key)


def _preamble(spec: JobSpec) -> str:
    return "\n".join([
        "",
        "set -euo pipefail",
        *_run_dir_lines(spec),
        f"cd {q(spec.workdir)}",
        'mkdir -p "$RUN_DIR/logs" "$RUN_DIR/slurm" "$RUN_DIR/monitor"',
        'echo "hpctrain: job $SLURM_JOB_ID (restart ${SLURM_RESTART_COUNT:-0}) on $SLURM_JOB_NODELIST, '
        'started $(date -Is)"',
    ])


def _run_dir_lines(spec: JobSpec) -> list[str]:
    if spec.array is None:
        return [f"RUN_DIR={q(spec.run_dir)}"]
    return [
        f"SWEEP_DIR={q(spec.array.sweep_dir)}",
        "# this array task's point of the sweep: its own run dir, config, checkpoints (a requeue resumes it alone)",
        "POINTS=(" + " ".join(q(p) for p in spec.array.points) + ")",
        'POINT="${POINTS[$SLURM_ARRAY_TASK_ID]}"',
        'RUN_DIR="$SWEEP_DIR/$POINT"',
        'echo "hpctrain: sweep point $POINT (array task $SLURM_ARRAY_TASK_ID of job $SLURM_ARRAY_JOB_ID)"',
    ]


def _environment(spec: JobSpec) -> str:
    s = spec.slurm
    lines = ["", "# --- environment ---"]
    if s.modules:
        lines += ["module purge", "module load " + " ".join(q(m) for m in s.modules)]
    if spec.venv and not s.container:
        # activate scripts read unset variables; set -u would stop the job
        lines += ["set +u", f"source {q(spec.venv + '/bin/activate')}", "set -u"]
    lines += list(s.setup)
    lines += [
        "# srun does not inherit --cpus-per-task since Slurm 22.05: pass it on, or every task gets one CPU",
        f"export SRUN_CPUS_PER_TASK={task_cpus(s)}",
        "# half of each process's CPUs for its own threads, the other half for its loader workers",
        f"export OMP_NUM_THREADS={max(1, cpus_per_task(s) // s.gpus_per_node // 2)}",
        "export PYTHONUNBUFFERED=1",
    ]
    lines += [f"export {name}={q(value)}" for name, _, value in (e.partition("=") for e in s.env)]
    if s.monitor_every_s:
        who = "each node's first task (SLURM_LOCALID 0)" if s.launcher == "srun" else "each node's launcher"
        lines += [
            f"# {who} records top (and nvidia-smi dmon) into the run dir and stops them on exit",
            'export HPCTRAIN_MONITOR_DIR="$RUN_DIR/monitor"',
            f"export HPCTRAIN_MONITOR_EVERY={s.monitor_every_s}",
        ]
    return "\n".join(lines)


NCCL_PRESETS = {
    "infiniband": [("NCCL_NET", "IB"), ("NCCL_IB_DISABLE", "0"), ("NCCL_NET_GDR_LEVEL", "PHB")],
    "ethernet": [("NCCL_NET", "Socket"), ("NCCL_IB_DISABLE", "1")],
    "none": [],
}


def _network(spec: JobSpec) -> str:
    s = spec.slurm
    lines = ["", "# --- network ---"]
    preset = s.nccl
    if preset != "none" or s.nccl_socket_ifname or s.nccl_debug:
        lines.append(f"# NCCL preset: {preset}")
    lines += [f"export {k}={v}" for k, v in NCCL_PRESETS[preset]]
    if s.nccl_socket_ifname:
        lines.append(f"export NCCL_SOCKET_IFNAME={q(s.nccl_socket_ifname)}")
    if s.nccl_debug:
        lines.append(f"export NCCL_DEBUG={s.nccl_debug}")
    if s.nodes > 1 or s.launcher == "srun":  # srun tasks meet there even on one node (hpctrain.dist.env)
        lines += [
            'mapfile -t NODES < <(scontrol show hostnames "$SLURM_JOB_NODELIST")',
            'export MASTER_ADDR="${NODES[0]}"',
            f"export MASTER_PORT={rendezvous_port(s)}",
        ]
    return "\n".join(lines)


def _config(spec: JobSpec) -> str:
    if spec.array is not None:
        return "\n".join([
            "",
            "# --- the point's resolved config, written by 'hpctrain sweep submit' (a requeued task runs the same) ---",
            'CONFIG="$RUN_DIR/slurm/config_$SLURM_JOB_ID.toml"',
            'cp "$SWEEP_DIR/configs/$POINT.toml" "$CONFIG.tmp"',
            'mv -f "$CONFIG.tmp" "$CONFIG"',
        ])
    return "\n".join([
        "",
        "# --- the resolved config, fixed at render time (a requeued job runs the same config) ---",
        'CONFIG="$RUN_DIR/slurm/config_$SLURM_JOB_ID.toml"',
        f"cat > \"$CONFIG.tmp\" <<'{CONFIG_DELIMITER}'",
        spec.config_toml.rstrip("\n"),
        CONFIG_DELIMITER,
        'mv -f "$CONFIG.tmp" "$CONFIG"',
    ])


def launcher_args(spec: JobSpec, rdzv_id: str = '"$SLURM_JOB_ID"') -> list[str]:
    """torchrun arguments (shell words; the $VARIABLES are expanded by the batch shell)."""
    s = spec.slurm
    nproc = spec.nproc_per_node or s.gpus_per_node
    if s.nodes == 1:
        return ["--standalone", "--nnodes=1", f"--nproc-per-node={nproc}"]
    return [
        '--nnodes="$SLURM_JOB_NUM_NODES"', f"--nproc-per-node={nproc}",
        "--rdzv-backend=c10d", '--rdzv-endpoint="$MASTER_ADDR:$MASTER_PORT"', f"--rdzv-id={rdzv_id}",
        "--max-restarts=0",
    ]


def _step_prefix(spec: JobSpec, rdzv_id: str = '"$SLURM_JOB_ID"') -> list[str]:
    """srun + container + torchrun (or, with slurm.launcher=srun, the per-task entry), up to the hpctrain command:
    the same for the pre-flight and the training."""
    s = spec.slurm
    python = spec.python if not s.container else (spec.python if spec.slurm.python else "python")
    cmd = ["srun", "--kill-on-bad-exit=1", f"--ntasks-per-node={tasks_per_node(s)}", f"--cpus-per-task={task_cpus(s)}"]
    cmd += gpu_binding(s) + _container_prefix(spec)
    if s.launcher == "srun":
        return cmd + [q(python), "-u", "-m", "hpctrain.slurm.task"]
    cmd += [q(python), "-u", "-m", "hpctrain.launch"] + launcher_args(spec, rdzv_id)
    return cmd + ([q(p) for p in spec.script.program] if spec.script else ["-m", "hpctrain"])


def _preflight(spec: JobSpec) -> list[str]:
    if not spec.slurm.preflight:
        return []
    cmd = _step_prefix(spec, '"$SLURM_JOB_ID-preflight"')
    cmd += ["doctor", "--perf", '--out "$RUN_DIR/preflight/$SLURM_JOB_ID"'] + [q(a) for a in spec.slurm.preflight_args]
    return [
        "",
        "# --- pre-flight: all-reduce bandwidth, matmul throughput, stragglers on every rank; stop on a failure ---",
        "PREFLIGHT=(" + " ".join(cmd) + ")",
        'if ! "${PREFLIGHT[@]}"; then',
        '  echo "hpctrain: the pre-flight failed, not training: $RUN_DIR/preflight/$SLURM_JOB_ID/preflight.md"',
        "  exit 1",
        "fi",
    ]


def _container_prefix(spec: JobSpec) -> list[str]:
    s = spec.slurm
    if not s.container:
        return []
    words = [s.container_runtime, "exec"]
    if s.gpus:
        words.append("--nv")
    binds = ['"$RUN_DIR"', q(spec.workdir)] + [q(b) for b in s.container_binds]
    for b in binds:
        words += ["--bind", b]
    return words + [q(s.container)]


def _launch(spec: JobSpec) -> str:
    s = spec.slurm
    if spec.script is not None:
        cmd = _step_prefix(spec) + script_arguments(spec)
        title = "# --- launch: one torchrun per node over the script ---"
    elif s.launcher == "srun":
        cmd = _step_prefix(spec) + ["train", q(spec.experiment), '--config "$CONFIG"']
        bound = (", each bound to one GPU" if gpu_binding(s) else ", each seeing all of the node's GPUs") if s.gpus else ""
        tasks = f"{s.gpus_per_node} tasks" if s.gpus_per_node > 1 else "1 task"
        title = f"# --- launch: {tasks} per node, one per process{bound} (srun, no torchrun) ---"
    else:
        cmd = _step_prefix(spec) + ["train", q(spec.experiment), '--config "$CONFIG"']
        title = "# --- launch: one torchrun per node ---"
    lines = _preflight(spec) + [
        "",
        title,
        *point_arguments(spec),
        "LAUNCH=(" + " ".join(cmd) + ")",
        'printf "%q " "${LAUNCH[@]}" > "$RUN_DIR/slurm/launch_$SLURM_JOB_ID.sh"',
        'echo "hpctrain: launching: $(cat "$RUN_DIR/slurm/launch_$SLURM_JOB_ID.sh")"',
        "",
        "# Slurm's job statistics go into the run dir: sstat while the step runs, sacct (and seff) at the end.",
        "job_stats() {",
        '  local out="$RUN_DIR/monitor/sstat_$SLURM_JOB_ID.txt"',
        '  # keep the last snapshot of a running step (sstat shows nothing once a step has ended)',
        '  if sstat --allsteps --parsable2 --format=JobID,AveCPU,MaxRSS,MaxRSSNode,AveRSS,MaxDiskRead,MaxDiskWrite '
        '-j "$SLURM_JOB_ID" > "$out.tmp" 2> /dev/null && [ "$(wc -l < "$out.tmp")" -gt 1 ]; then '
        'mv -f "$out.tmp" "$out"; else rm -f "$out.tmp"; fi',
        "}",
        "finish() {",
        '  sacct --parsable2 --format=JobID,JobName,State,ExitCode,Elapsed,TotalCPU,MaxRSS,NodeList '
        '-j "$SLURM_JOB_ID" > "$RUN_DIR/monitor/sacct_$SLURM_JOB_ID.txt" 2>&1 || true',
        '  if command -v seff > /dev/null; then seff "$SLURM_JOB_ID" > "$RUN_DIR/monitor/seff_$SLURM_JOB_ID.txt" 2>&1 || true; fi',
        '  if [ -n "${STATS_PID:-}" ]; then kill "$STATS_PID" 2> /dev/null || true; fi',
        "}",
        "trap finish EXIT",
    ]
    if spec.warning_signal != "none":
        sig = spec.warning_signal.removeprefix("SIG")
        lines += [
            f"# --signal=B:{sig} reaches only this shell: pass it to srun, which passes it to every task",
            f'trap \'echo "hpctrain: got SIG{sig}, passing it to the job step"; '
            f'kill -{sig} "${{SRUN_PID:-}}" 2> /dev/null || true\' {sig}',
        ]
    lines += [
        '"${LAUNCH[@]}" &',
        "SRUN_PID=$!",
        "( sleep 5; while true; do job_stats; sleep 30; done ) &",
        "STATS_PID=$!",
        "# wait returns early when a trapped signal arrives: wait again until srun has really ended;",
        "# bash keeps the status of an ended child, so the last wait gives srun's own exit code",
        'while kill -0 "$SRUN_PID" 2> /dev/null; do wait "$SRUN_PID" || true; done',
        'rc=0; wait "$SRUN_PID" || rc=$?',
    ]
    lines += script_end(spec) if spec.script is not None else [
        'echo "hpctrain: job step ended with exit code $rc at $(date -Is)"',
        'exit "$rc"',
    ]
    return "\n".join(lines)
