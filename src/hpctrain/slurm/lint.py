"""Lint a job before it is submitted: the mistakes that otherwise cost a queue wait to find.

:func:`lint` is pure over a config and :class:`Facts` (what was found on this machine
and in ``sinfo``); :func:`hpctrain.slurm.facts.gather_facts` collects those. Each finding names the key and
says what to do.
"""

from __future__ import annotations

import os
import shlex
from dataclasses import dataclass
from typing import Literal

from hpctrain.config.batch import batch_sizes
from hpctrain.config.schema import RunConfig, SlurmSection
from hpctrain.errors import UserError
from hpctrain.filesystems import NETWORK_FS, NODE_LOCAL_FS
from hpctrain.slurm.facts import PER_JOB_VARIABLE, Facts, NodeFacts
from hpctrain.slurm.render import JobSpec, cpus_per_task
from hpctrain.units import format_duration, time_limit_seconds
from hpctrain.units import format_size

NODE_LOCAL_DIRS = ("/tmp", "/dev/shm", "/var/tmp", "/scratch/local", "/local")
# Shards a node's page cache keeps are read from the shared filesystem once (the first epoch), staged or not:
# staging pays off above that. Without sinfo: half of a 64 GB node.
PAGE_CACHE_SHARE = 0.5
DEFAULT_PAGE_CACHE = 32 * 10**9


@dataclass(frozen=True)
class Finding:
    level: Literal["error", "warning", "info"]
    key: str
    message: str
    hint: str

    def format(self) -> str:
        return f"{self.level.upper():7s} {self.key}: {self.message}\n        -> {self.hint}"


def lint(cfg: RunConfig, spec: JobSpec, facts: Facts) -> list[Finding]:
    findings: list[Finding] = []
    for check in (_batch, _cpus, _srun_share, _time, _run_dir, _workdir, _environment, _partition, _staging,
                  _shard_local, _array, _processes, _script):
        findings += check(cfg, spec, facts)
    return sorted(findings, key=lambda f: ("error", "warning", "info").index(f.level))


def _batch(cfg: RunConfig, spec: JobSpec, facts: Facts) -> list[Finding]:
    if spec.script is not None:  # the script's batches are its own
        return []
    world = cfg.slurm.nodes * cfg.slurm.gpus_per_node
    try:
        batch_sizes(cfg.train.global_batch_size, cfg.train.micro_batch_size, world)
    except UserError as err:
        return [Finding("error", "train.global_batch_size",
                        f"{str(err).splitlines()[0]} ({cfg.slurm.nodes} nodes x {cfg.slurm.gpus_per_node})", err.hint)]
    return []


def _cpus(cfg: RunConfig, spec: JobSpec, facts: Facts) -> list[Finding]:
    s, procs = cfg.slurm, cfg.slurm.gpus_per_node
    cpus, most = cpus_per_task(s), node_cpus(s, facts)
    if cpus < procs:
        return [Finding("error", "slurm.cpus_per_task", f"{cpus} CPUs for {procs} processes per node",
                        _more_cpus_hint(procs, cfg.data.num_workers, most, _where(s)))]
    workers = cfg.data.num_workers
    if workers > 0 and procs * (workers + 1) > cpus and spec.script is None:  # a script's loaders are its own
        return [Finding("warning", "data.num_workers",
                        f"{procs} processes x ({workers} workers + 1) = {procs * (workers + 1)} busy processes on "
                        f"{cpus} CPUs per node; they will share CPUs and the loader may starve the GPUs",
                        _fewer_workers_hint(procs, workers, cpus, most, _where(s)))]
    return []


def _srun_share(cfg: RunConfig, spec: JobSpec, facts: Facts) -> list[Finding]:
    """slurm.launcher=srun splits the node's CPUs into one --cpus-per-task share per task: a remainder sits idle."""
    s, procs = cfg.slurm, cfg.slurm.gpus_per_node
    cpus = cpus_per_task(s)
    if s.launcher != "srun" or cpus < procs or cpus % procs == 0:  # too few CPUs: _cpus reports it
        return []
    share, most = cpus // procs, node_cpus(s, facts)
    options = [f"slurm.cpus_per_task={share * procs}"]
    if most and (share + 1) * procs <= most:
        options.append(f"slurm.cpus_per_task={(share + 1) * procs}")
    return [Finding("warning", "slurm.cpus_per_task",
                    f"{cpus} CPUs per node do not divide among {procs} srun tasks: each gets {share} "
                    f"(--cpus-per-task), {cpus - share * procs} stay idle",
                    "use a multiple of slurm.gpus_per_node: " + " or ".join(options))]


def _more_cpus_hint(procs: int, workers: int, most: int, where: str) -> str:
    """Too few CPUs for the processes: a cpus_per_task the partition's nodes can hold (``most``, 0: unknown)."""
    if not most:  # no sinfo here: the default share, 8 CPUs per process
        return f"give every process at least one CPU and its loader workers more: slurm.cpus_per_task={procs * 8}"
    if most < procs:  # no cpus_per_task fits: fewer processes per node
        return (f"nodes of {where} have {most} CPUs, fewer than {procs} processes: run at most {most} per node, "
                f"slurm.gpus_per_node={most} and slurm.cpus_per_task={most}, with more slurm.nodes to keep the "
                "number of processes")
    if most >= procs * 8:
        return f"give every process at least one CPU and its loader workers more: slurm.cpus_per_task={procs * 8}"
    return (f"give the processes all {most} CPUs that nodes of {where} have: slurm.cpus_per_task={most}"
            + _workers_that_fit(procs, workers, most))


def _fewer_workers_hint(procs: int, workers: int, cpus: int, most: int, where: str) -> str:
    """Loader workers beyond the CPUs: more CPUs only where the nodes have them, else fewer workers."""
    need, auto = procs * (workers + 1), "(or -1: chosen from the CPUs the job gets)"
    fit = f"data.num_workers={max(0, min(cpus, most or cpus) // procs - 1)}"
    if not most or need <= most:
        return f"set slurm.cpus_per_task={need} or {fit} {auto}"
    if cpus < most:  # more CPUs help, but not enough for all these workers
        return (f"nodes of {where} have {most} CPUs, too few for {need} busy processes: set {fit}, or "
                f"slurm.cpus_per_task={most}"
                f"{_workers_that_fit(procs, workers, most)} {auto}")
    return f"nodes of {where} have {most} CPUs, too few for {need} busy processes: set {fit} {auto}"


def _workers_that_fit(procs: int, workers: int, cpus: int) -> str:
    """' with data.num_workers=N' when the configured workers would not fit ``cpus``; '' otherwise."""
    if workers > 0 and procs * (workers + 1) > cpus:
        return f" with data.num_workers={max(0, cpus // procs - 1)}"
    return ""


def _time(cfg: RunConfig, spec: JobSpec, facts: Facts) -> list[Finding]:
    s, out = cfg.slurm, []
    limit = time_limit_seconds(s.time)
    warned = cfg.fault.warning_signal != "none" and s.signal_lead_s > 0
    if limit is not None and warned and s.signal_lead_s >= limit:
        out.append(Finding("error", "slurm.signal_lead_s",
                           f"the warning comes {s.signal_lead_s} s before the end of a {format_duration(limit)} job, "
                           "that is before it starts",
                           f"use a lead time well below slurm.time: slurm.signal_lead_s={_lead_for(limit)}"))
    elif warned and s.signal_lead_s < 60:
        out.append(Finding("warning", "slurm.signal_lead_s",
                           f"{s.signal_lead_s} s between the warning and the kill; Slurm may send it up to 60 s late",
                           f"give the checkpoint time to finish: slurm.signal_lead_s={_lead_for(limit)}"))
    if not warned:
        out.append(Finding("warning", "fault.warning_signal",
                           "no warning signal before the time limit: the work since the last checkpoint is lost",
                           f"keep fault.warning_signal=SIGUSR2 and slurm.signal_lead_s={_lead_for(limit)}"))
    every = cfg.ckpt.every_minutes * 60
    if limit is not None and (every == 0 or every >= limit) and cfg.ckpt.every_steps == 0 and spec.script is None:
        out.append(Finding("warning", "ckpt.every_minutes",
                           f"no periodic checkpoint within the {format_duration(limit)} time limit: a crash or node "
                           "failure loses the whole allocation",
                           f"save at least every {_quarter_minutes(limit)} minutes: "
                           f"ckpt.every_minutes={_quarter_minutes(limit)}, or every N steps (ckpt.every_steps)"))
    return out


def _lead_for(limit: int | None) -> int:
    """A warning lead the time limit leaves room for: 120 s; in a shorter job half of it, but not below the 60 s
    that Slurm may be late by (the lint would warn about its own advice), and always before the job's end."""
    return 120 if limit is None else max(1, min(120, max(60, limit // 2), limit - 1))


def _quarter_minutes(limit: int) -> float:
    """A quarter of the time limit in minutes (whole minutes from 4 minutes up): below the limit, > 0."""
    return limit // 240 if limit >= 240 else round(limit / 240, 2) or 0.01


def _node_local_dir(path: str) -> str:
    return next((d for d in NODE_LOCAL_DIRS if path == d or path.startswith(d + "/")), "")


def _run_dir(cfg: RunConfig, spec: JobSpec, facts: Facts) -> list[Finding]:
    path = spec.run_dir
    local_dir = _node_local_dir(path)
    if facts.run_dir_parent == "/" and not local_dir:
        top = "/" + path.strip("/").split("/")[0]
        return [Finding("warning", "run.dir",
                        f"{path} does not exist here, nor does {top}: it may be a filesystem mounted on the compute "
                        "nodes only (then all is well), or a typo (then the job fails at its start)",
                        f"check the path on a compute node ({shlex.join(['srun', 'ls', '-d', top])}); hpctrain creates the "
                        "run dir itself "
                        "when its parent exists")]
    if facts.run_dir_parent and not local_dir and facts.run_dir_fs in NODE_LOCAL_FS and cfg.slurm.nodes > 1:
        return [Finding("warning", "run.dir",
                        f"{path} does not exist yet; it would be created under {facts.run_dir_parent}, on a "
                        f"{facts.run_dir_fs} filesystem, which usually exists only on one node: other nodes (and a "
                        "requeued job on another node) could not see its checkpoints",
                        "put the run dir on the shared filesystem (home, project or scratch space of the cluster)")]
    if local_dir or (cfg.slurm.nodes > 1 and facts.run_dir_fs in NODE_LOCAL_FS):
        where = f"under {local_dir}" if local_dir else f"on a {facts.run_dir_fs} filesystem"
        return [Finding("warning", "run.dir",
                        f"{path} is {where}, which usually exists only on one node: other nodes (and a requeued "
                        "job on another node) cannot see its checkpoints",
                        "put the run dir on the shared filesystem (home, project or scratch space of the cluster)")]
    return []


def _workdir(cfg: RunConfig, spec: JobSpec, facts: Facts) -> list[Finding]:
    """The job cds into the working directory and imports a module:Class experiment from there: a node-local folder
    (this machine's /tmp) is not where the compute nodes look."""
    local_dir = _node_local_dir(spec.workdir)
    if not facts.module_file or not (local_dir or (cfg.slurm.nodes > 1 and facts.workdir_fs in NODE_LOCAL_FS)):
        return []
    where = f"under {local_dir}" if local_dir else f"on a {facts.workdir_fs} filesystem"
    return [Finding("warning", "experiment",
                    f"the job will cd into {spec.workdir} and import {facts.module_file} from there, but that folder "
                    f"is {where}, which usually exists only on this machine: the compute nodes will not find it",
                    "render and submit from a folder on the shared filesystem that holds your module, or install it "
                    "into the job's environment (pip install -e .)")]


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
    if cfg.dist.backend == "nccl" and not s.gpus and spec.script is None:  # a script picks its own backend
        out.append(Finding("error", "dist.backend", "nccl needs GPUs but slurm.gpus=false",
                           "use dist.backend=auto (gloo without GPUs) or request GPUs"))
    return out


def _staging(cfg: RunConfig, spec: JobSpec, facts: Facts) -> list[Finding]:
    """Shards on a network filesystem, too large for the page cache, and not staged; a stage dir that cannot
    hold them."""
    stage, size = cfg.data.stage_dir, facts.data_bytes
    if not size:
        return []
    where = os.path.commonpath(facts.data_dirs) if facts.data_dirs else "the data"
    if not stage:
        cache = page_cache_bytes(cfg.slurm, facts)
        # shard_local reads about the set once per epoch across all nodes: less than a staged copy on every node,
        # for fewer epochs than nodes.
        if facts.data_fs not in NETWORK_FS or size <= cache or cfg.data.order == "shard_local":
            return []
        return [Finding("warning", "data.stage_dir",
                        f"the shards in {where} ({format_size(size)}) are on a {facts.data_fs} filesystem and larger "
                        f"than a node's page cache keeps (about {format_size(cache)}): in the exact order every node "
                        "reads up to all of them from it in every epoch",
                        f"copy them once per node and job to a node-local disk: data.stage_dir=$TMPDIR (or a local "
                        f"NVMe path); the cost is {format_size(size)} read per node when each job starts")]
    if facts.stage_fs in NETWORK_FS:
        return [Finding("warning", "data.stage_dir",
                        f"{stage} is on a {facts.stage_fs} filesystem: staging would copy the shards from one shared "
                        "filesystem to another", "point data.stage_dir at a node-local disk ($TMPDIR, a local NVMe)")]
    if facts.stage_free < 0:
        why = "is set per node and job" if PER_JOB_VARIABLE.search(stage) else \
            "does not exist here (only on the compute nodes?)"
        return [Finding("info", "data.stage_dir", f"{stage} {why}: its free space cannot be checked here",
                        f"make sure it holds {format_size(size)} on every node (one copy of the shards per node)")]
    if facts.stage_free < size:
        return [Finding("warning", "data.stage_dir",
                        f"{stage} has {format_size(facts.stage_free)} free here, the shards in {where} need "
                        f"{format_size(size)}: staging would stop with an error",
                        "point data.stage_dir at a larger node-local disk, free space there, or leave it empty to "
                        "read the shards where they are")]
    return []


def _shard_local(cfg: RunConfig, spec: JobSpec, facts: Facts) -> list[Finding]:
    """data.order=shard_local deals shards to ranks: a shard count far from a multiple of the ranks makes many
    ranks borrow samples from others' shards."""
    world = cfg.slurm.nodes * cfg.slurm.gpus_per_node
    if cfg.data.order != "shard_local" or not facts.train_shards:
        return []
    # here, not at the top: data.shard_local imports torch, which `hpctrain slurm status/cancel` need not wait for
    from hpctrain.data.shard_local import MAX_BORROWED, borrowed_share, good_shard_count

    share = borrowed_share(facts.train_shards, world)
    if share <= MAX_BORROWED:
        return []
    good = good_shard_count(facts.train_shards, world)
    return [Finding("warning", "data.order",
                    f"data.order=shard_local with {facts.train_shards} training shards for {world} ranks: up to about "
                    f"{share:.0%} of each epoch is read from other ranks' shards, which undoes the local reads",
                    f"write a multiple of {world} shards, e.g. {good} (hpctrain shard --shard-size about "
                    f"{max(1, int(facts.train_bytes / good // 10**6))}MB), or use data.order=exact")]


def page_cache_bytes(s: SlurmSection, facts: Facts) -> int:
    """What a node's page cache can be expected to keep: a share of the memory of the partition's smallest usable
    node (sinfo), or DEFAULT_PAGE_CACHE where that is unknown."""
    usable = _usable_nodes(s, facts)
    return int(PAGE_CACHE_SHARE * min(n.memory_mb for n in usable) * 2**20) if usable else DEFAULT_PAGE_CACHE


def _partition(cfg: RunConfig, spec: JobSpec, facts: Facts) -> list[Finding]:
    s = cfg.slurm
    if not facts.nodes:
        if not facts.partition_note:
            return []
        return [Finding("info", "slurm.partition",
                        f"the partition checks (GPUs, CPUs and memory per node) were skipped: {facts.partition_note}",
                        "run `hpctrain slurm check` on a login node whose sinfo reaches the cluster's controller")]
    cpus, out, where = cpus_per_task(s), [], _where(s)
    most_gpus = max(n.gpus for n in facts.nodes)
    if s.gpus and most_gpus < s.gpus_per_node:
        fix = (f"use slurm.gpus_per_node={most_gpus} with more slurm.nodes" if most_gpus
               else "set slurm.gpus=false (CPU-only nodes, gloo)")
        out.append(Finding("error", "slurm.gpus_per_node",
                           f"{s.gpus_per_node} GPUs per node requested; nodes of {where} have at most {most_gpus}",
                           f"{fix}, or pick another partition"))
    if max(n.cpus for n in facts.nodes) < cpus:
        out.append(Finding("error", "slurm.cpus_per_task",
                           f"{cpus} CPUs per node requested; nodes of {where} have at most {max(n.cpus for n in facts.nodes)}",
                           _fewer_cpus_hint(s.gpus_per_node, cfg.data.num_workers, node_cpus(s, facts), where)))
    elif (have := sum(n.count for n in _usable_nodes(s, facts) if n.cpus >= cpus)) < s.nodes:
        out.append(Finding("error", "slurm.nodes", f"{s.nodes} nodes requested; {where} has {have} that fit the request",
                           _fewer_nodes_hint(s, facts, have, node_cpus(s, facts))))
    return out


def _fewer_cpus_hint(procs: int, workers: int, most: int, where: str) -> str:
    if most < procs:
        return _more_cpus_hint(procs, workers, most, where)
    return f"ask for what nodes of {where} have: slurm.cpus_per_task={most}{_workers_that_fit(procs, workers, most)}"


def _fewer_nodes_hint(s: SlurmSection, facts: Facts, have: int, most: int) -> str:
    """Fewer nodes, or fewer CPUs per node where that lets enough nodes fit."""
    options = [f"use slurm.nodes={have}"] if have else []
    enough = sum(n.count for n in _usable_nodes(s, facts) if n.cpus >= most) >= s.nodes
    if enough and s.gpus_per_node <= most < cpus_per_task(s):
        options.append(f"ask for the CPUs that {s.nodes} of its nodes all have: slurm.cpus_per_task={most}")
    return " or ".join(options) or "lower the per-node request (GPUs, CPUs), or pick another partition"


def _where(s: SlurmSection) -> str:
    return f"partition {s.partition}" if s.partition else "the default partition"


def _usable_nodes(s: SlurmSection, facts: Facts) -> list[NodeFacts]:
    """Node types with the GPUs the job asks for (all of them without GPUs)."""
    return [n for n in facts.nodes if not s.gpus or n.gpus >= s.gpus_per_node]


def node_cpus(s: SlurmSection, facts: Facts) -> int:
    """The most CPUs per node that slurm.nodes nodes of the partition all have, among those with the GPUs asked
    for: what a hint may propose for slurm.cpus_per_task. Too few such nodes: the most any has (slurm.nodes is
    then the finding). 0: the partition is unknown (no sinfo here)."""
    usable = _usable_nodes(s, facts) or list(facts.nodes)
    enough = [c for c in {n.cpus for n in usable} if sum(n.count for n in usable if n.cpus >= c) >= s.nodes]
    return max(enough or [n.cpus for n in usable], default=0)


def _array(cfg: RunConfig, spec: JobSpec, facts: Facts) -> list[Finding]:
    """A sweep's array against the cluster's MaxArraySize (its indices 0..N-1 must stay below it)."""
    if spec.array is None or not facts.max_array_size or len(spec.array.points) <= facts.max_array_size:
        return []
    n = len(spec.array.points)
    return [Finding("error", "--grid", f"the sweep's array has {n} tasks (indices 0 to {n - 1}); this cluster's "
                    f"MaxArraySize is {facts.max_array_size} (indices must stay below it)",
                    f"split the grid into sweeps of at most {facts.max_array_size} points (--max-parallel limits "
                    "how many run at once, not how many the array holds), or ask your admins.")]


GPU_REQUESTS = ("--gres", "--gpus", "-G", "--gpus-per-node", "--gpus-per-task", "--ntasks-per-node")
"""sbatch options of slurm.extra_sbatch that would ask for GPUs or tasks besides the job's own --gres request and
its one task (torchrun) per node."""


def _processes(cfg: RunConfig, spec: JobSpec, facts: Facts) -> list[Finding]:
    """torchrun's processes per node (--nproc-per-node) against the GPUs the job asks for (--gres=gpu:G from
    slurm.gpus_per_node), and no second GPU request in slurm.extra_sbatch."""
    s, out = cfg.slurm, []
    n = spec.nproc_per_node
    if n and n != s.gpus_per_node:
        asked = (f"--gres=gpu:{s.gpu_type + ':' if s.gpu_type else ''}{s.gpus_per_node}" if s.gpus
                 else f"slurm.gpus_per_node={s.gpus_per_node} (with slurm.gpus=false: the processes per node)")
        out.append(Finding("error", "--nproc-per-node",
                           f"torchrun would start {n} processes per node, but the job asks for {asked}",
                           f"one process per GPU: --nproc-per-node {s.gpus_per_node}, or slurm.gpus_per_node={n}"))
    for item in s.extra_sbatch:
        option = item.split("=", 1)[0]
        if option in GPU_REQUESTS:
            out.append(Finding("warning", "slurm.extra_sbatch",
                               f"{option} in slurm.extra_sbatch asks again for what the job script asks for itself "
                               f"(--gres=gpu:G from slurm.gpus_per_node, one task per node for torchrun): the "
                               "two requests can contradict each other",
                               "drop it, and set slurm.gpus_per_node (and slurm.gpu_type) instead"))
    return out


def _script(cfg: RunConfig, spec: JobSpec, facts: Facts) -> list[Finding]:
    """A script job's script: there, a file, readable, and on a filesystem the compute nodes see."""
    target = cfg.script
    if spec.script is None or target is None:
        return []
    where = f"the job runs in {spec.workdir}, and relative paths are from there"
    if target.module:
        if facts.script_problem != "missing":
            return []
        return [Finding("warning", "--module", f"no module {target.module} is found from {spec.workdir} or this "
                        "Python's packages (it may be installed on the compute nodes only)",
                        f"{where}: submit from the folder that holds it, or install it into the job's environment")]
    path, problem = facts.script_file, facts.script_problem
    if problem == "missing":
        return [Finding("error", "--script", f"script {path} does not exist", f"check the path; {where}")]
    if problem == "directory":
        return [Finding("error", "--script", f"{path} is a directory, not a script",
                        "name the .py file that torchrun should run")]
    if problem:
        return [Finding("error", "--script", f"script {path} cannot be read: {problem}",
                        f"make it readable for the job's user (chmod a+r {shlex.quote(path)})")]
    local_dir = _node_local_dir(path)
    if local_dir or (cfg.slurm.nodes > 1 and facts.script_fs in NODE_LOCAL_FS):
        how = f"under {local_dir}" if local_dir else f"on a {facts.script_fs} filesystem"
        return [Finding("warning", "--script", f"{path} is {how}, which usually exists only on this machine: the "
                        "compute nodes may not find it", "put the script on the shared filesystem (home, project or "
                        "scratch space of the cluster) and submit from there")]
    return []
