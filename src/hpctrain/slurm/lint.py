"""Lint a job before it is submitted: the mistakes that otherwise cost a queue wait to find.

:func:`lint` is pure over a config and :class:`Facts` (what was found on this machine
and in ``sinfo``); :func:`gather_facts` collects those. Each finding names the key and
says what to do.
"""

from __future__ import annotations

import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from hpctrain.config.batch import plan_batches
from hpctrain.config.schema import RunConfig
from hpctrain.dist.env import module_system_present
from hpctrain.errors import UserError
from hpctrain.slurm.render import JobSpec, cpus_per_task
from hpctrain.slurm.timelimit import format_duration, time_limit_seconds

# Filesystems that live on one node: a multi-node job's other nodes cannot see a run dir there.
NODE_LOCAL_FS = frozenset({"tmpfs", "ramfs", "ext2", "ext3", "ext4", "xfs", "btrfs", "overlay", "f2fs", "zfs"})
NODE_LOCAL_DIRS = ("/tmp", "/dev/shm", "/var/tmp", "/scratch/local", "/local")


@dataclass(frozen=True)
class Finding:
    level: Literal["error", "warning"]
    key: str
    message: str
    hint: str

    def format(self) -> str:
        return f"{self.level.upper():7s} {self.key}: {self.message}\n        -> {self.hint}"


@dataclass(frozen=True)
class NodeFacts:
    """One node type of the partition, from sinfo."""

    cpus: int
    gpus: int
    memory_mb: int
    count: int


@dataclass(frozen=True)
class Facts:
    run_dir_fs: str = ""
    """Filesystem type of the run dir (from /proc/mounts); '' if unknown."""
    existing: frozenset[str] = frozenset()
    """Which of the paths the job needs exist here."""
    commands: frozenset[str] = frozenset()
    """Which of the commands the job uses are on PATH here."""
    module_system: bool = False
    """Environment modules (Lmod or Tcl) are set up here."""
    nodes: tuple[NodeFacts, ...] = field(default_factory=tuple)
    """Node types of the partition; empty when sinfo is not available."""


def lint(cfg: RunConfig, spec: JobSpec, facts: Facts) -> list[Finding]:
    findings: list[Finding] = []
    for check in (_batch, _cpus, _time, _run_dir, _environment, _partition):
        findings += check(cfg, spec, facts)
    return sorted(findings, key=lambda f: f.level != "error")


def _batch(cfg: RunConfig, spec: JobSpec, facts: Facts) -> list[Finding]:
    world = cfg.slurm.nodes * cfg.slurm.gpus_per_node
    try:
        plan_batches(cfg.train.global_batch_size, cfg.train.micro_batch_size, world)
    except UserError as err:
        return [Finding("error", "train.global_batch_size",
                        f"{str(err).splitlines()[0]} ({cfg.slurm.nodes} nodes x {cfg.slurm.gpus_per_node})", err.hint)]
    return []


def _cpus(cfg: RunConfig, spec: JobSpec, facts: Facts) -> list[Finding]:
    s, procs = cfg.slurm, cfg.slurm.gpus_per_node
    cpus = cpus_per_task(s)
    if cpus < procs:
        return [Finding("error", "slurm.cpus_per_task", f"{cpus} CPUs for {procs} processes per node",
                        f"give every process at least one CPU and its loader workers more: slurm.cpus_per_task={procs * 8}")]
    workers = cfg.data.num_workers
    if workers > 0 and procs * (workers + 1) > cpus:
        return [Finding("warning", "data.num_workers",
                        f"{procs} processes x ({workers} workers + 1) = {procs * (workers + 1)} busy processes on "
                        f"{cpus} CPUs per node; they will share CPUs and the loader may starve the GPUs",
                        f"set slurm.cpus_per_task={procs * (workers + 1)} or data.num_workers={max(0, cpus // procs - 1)} "
                        "(or -1: chosen from the CPUs the job gets)")]
    return []


def _time(cfg: RunConfig, spec: JobSpec, facts: Facts) -> list[Finding]:
    s, out = cfg.slurm, []
    limit = time_limit_seconds(s.time)
    warned = cfg.fault.warning_signal != "none" and s.signal_lead_s > 0
    if limit is not None and warned and s.signal_lead_s >= limit:
        out.append(Finding("error", "slurm.signal_lead_s",
                           f"the warning comes {s.signal_lead_s} s before the end of a {format_duration(limit)} job, "
                           "that is before it starts", "use a lead time well below slurm.time, e.g. 120"))
    elif warned and s.signal_lead_s < 60:
        out.append(Finding("warning", "slurm.signal_lead_s",
                           f"{s.signal_lead_s} s between the warning and the kill; Slurm may send it up to 60 s late",
                           "give the checkpoint time to finish: slurm.signal_lead_s=120 or more"))
    if not warned:
        out.append(Finding("warning", "fault.warning_signal",
                           "no warning signal before the time limit: the work since the last checkpoint is lost",
                           "keep fault.warning_signal=SIGUSR2 and slurm.signal_lead_s>0 (default 120)"))
    every = cfg.ckpt.every_minutes * 60
    if limit is not None and (every == 0 or every >= limit) and cfg.ckpt.every_steps == 0:
        out.append(Finding("warning", "ckpt.every_minutes",
                           f"no periodic checkpoint within the {format_duration(limit)} time limit: a crash or node "
                           "failure loses the whole allocation",
                           f"save at least every {max(1, limit // 240)} minutes (ckpt.every_minutes) or every N steps "
                           "(ckpt.every_steps)"))
    return out


def _run_dir(cfg: RunConfig, spec: JobSpec, facts: Facts) -> list[Finding]:
    path = spec.run_dir
    local_dir = next((d for d in NODE_LOCAL_DIRS if path == d or path.startswith(d + "/")), "")
    if local_dir or (cfg.slurm.nodes > 1 and facts.run_dir_fs in NODE_LOCAL_FS):
        where = f"under {local_dir}" if local_dir else f"on a {facts.run_dir_fs} filesystem"
        return [Finding("warning", "run.dir",
                        f"{path} is {where}, which usually exists only on one node: other nodes (and a requeued "
                        "job on another node) cannot see its checkpoints",
                        "put the run dir on the shared filesystem (home, project or scratch space of the cluster)")]
    return []


def _environment(cfg: RunConfig, spec: JobSpec, facts: Facts) -> list[Finding]:
    s, out = cfg.slurm, []
    if s.container:
        if s.container not in facts.existing:
            out.append(Finding("error", "slurm.container", f"image {s.container} does not exist here",
                               "build or pull it first (see docs/container.md), or fix the path"))
        if s.container_runtime not in facts.commands:
            out.append(Finding("warning", "slurm.container_runtime",
                               f"'{s.container_runtime}' is not on PATH here (it may be on the compute nodes)",
                               "load its module in slurm.modules, or check with your cluster's documentation"))
    elif spec.python not in facts.existing:
        out.append(Finding("error", "slurm.python", f"interpreter {spec.python} does not exist",
                           "set slurm.python to the Python of the environment hpctrain is installed in"))
    if spec.venv and spec.venv not in facts.existing:
        out.append(Finding("error", "slurm.python", f"virtual environment {spec.venv} does not exist",
                           "render from inside the environment the job should use"))
    if s.modules and not facts.module_system:
        out.append(Finding("warning", "slurm.modules", "no environment-module system (Lmod/Tcl) found here",
                           "the job's 'module load' fails where modules do not exist; empty slurm.modules there"))
    if cfg.dist.backend == "nccl" and not s.gpus:
        out.append(Finding("error", "dist.backend", "nccl needs GPUs but slurm.gpus=false",
                           "use dist.backend=auto (gloo without GPUs) or request GPUs"))
    return out


def _partition(cfg: RunConfig, spec: JobSpec, facts: Facts) -> list[Finding]:
    s = cfg.slurm
    if not facts.nodes:
        return []
    cpus, out = cpus_per_task(s), []
    fitting = [n for n in facts.nodes if n.cpus >= cpus and (not s.gpus or n.gpus >= s.gpus_per_node)]
    where = f"partition {s.partition}" if s.partition else "the default partition"
    if s.gpus and max(n.gpus for n in facts.nodes) < s.gpus_per_node:
        out.append(Finding("error", "slurm.gpus_per_node",
                           f"{s.gpus_per_node} GPUs per node requested; nodes of {where} have at most "
                           f"{max(n.gpus for n in facts.nodes)}",
                           "lower slurm.gpus_per_node and raise slurm.nodes, or pick another partition"))
    if max(n.cpus for n in facts.nodes) < cpus:
        out.append(Finding("error", "slurm.cpus_per_task",
                           f"{cpus} CPUs per node requested; nodes of {where} have at most {max(n.cpus for n in facts.nodes)}",
                           "lower slurm.cpus_per_task"))
    elif sum(n.count for n in fitting) < s.nodes:
        out.append(Finding("error", "slurm.nodes",
                           f"{s.nodes} nodes requested; {where} has {sum(n.count for n in fitting)} that fit the request",
                           "lower slurm.nodes or the per-node request"))
    return out


# --- facts of this machine ---

def filesystem_type(path: Path) -> str:
    """Type of the filesystem holding ``path`` (longest mount point prefix in /proc/mounts)."""
    path = path.resolve()
    while not path.exists():
        path = path.parent
    best, fstype = "", ""
    try:
        mounts = Path("/proc/mounts").read_text().splitlines()
    except OSError:
        return ""
    for line in mounts:
        parts = line.split()
        if len(parts) < 3:
            continue
        mount = parts[1].replace("\\040", " ")
        if (str(path) == mount or str(path).startswith(mount.rstrip("/") + "/")) and len(mount) >= len(best):
            best, fstype = mount, parts[2]
    return fstype


def partition_nodes(partition: str) -> tuple[NodeFacts, ...]:
    """Node types of a partition from sinfo (CPUs, GPUs from gres, memory, count); () without sinfo."""
    if shutil.which("sinfo") is None:
        return ()
    args = ["sinfo", "--noheader", "--format=%c|%G|%m|%D"] + ([f"--partition={partition}"] if partition else [])
    try:
        proc = subprocess.run(args, capture_output=True, text=True, timeout=20)
    except (subprocess.TimeoutExpired, OSError):
        return ()
    nodes = []
    for line in proc.stdout.splitlines() if proc.returncode == 0 else []:
        try:
            cpus, gres, mem, count = line.strip().split("|")
            nodes.append(NodeFacts(int(cpus), gres_gpus(gres), int(mem.rstrip("+")), int(count)))
        except ValueError:
            continue
    return tuple(nodes)


def gres_gpus(gres: str) -> int:
    """GPUs in a gres string like 'gpu:a100:4(S:0-1),shard:8' (0 for '(null)')."""
    total = 0
    for item in gres.split(","):
        item = item.split("(")[0]
        parts = item.split(":")
        if parts[0] == "gpu" and len(parts) >= 2 and parts[-1].isdigit():
            total += int(parts[-1])
    return total


def gather_facts(cfg: RunConfig, spec: JobSpec) -> Facts:
    s = cfg.slurm
    paths = [p for p in (spec.python, spec.venv, s.container) if p]
    return Facts(
        run_dir_fs=filesystem_type(Path(spec.run_dir)),
        # a bare name (slurm.python=python3) counts when it is on PATH here
        existing=frozenset(p for p in paths if Path(p).exists() or ("/" not in p and shutil.which(p))),
        commands=frozenset(c for c in (s.container_runtime,) if shutil.which(c)),
        module_system=module_system_present(),
        nodes=partition_nodes(s.partition),
    )
