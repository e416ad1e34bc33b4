"""What `hpctrain slurm check` finds on this machine and in ``sinfo`` (:class:`Facts`), for the pure lint
(:mod:`hpctrain.slurm.lint`): filesystems, paths and commands the job needs, the partition's nodes, the data's
shards and the stage dir's room."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

from hpctrain.config.schema import RunConfig
from hpctrain.config.target import is_script
from hpctrain.data.shards import MANIFEST
from hpctrain.data.staging import free_bytes
from hpctrain.dist.env import expand_path, module_system_present
from hpctrain.errors import UserError
from hpctrain.filesystems import filesystem_type
from hpctrain.slurm.render import JobSpec

# Variables that differ between the login node and a job's nodes: a stage dir naming one cannot be measured here.
PER_JOB_VARIABLE = re.compile(r"\$\{?(TMPDIR|SLURM_\w+|LOCAL\w*)\b")


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
    partition_note: str = ""
    """Why the partition's nodes are unknown (no sinfo here, or sinfo's error); '' when sinfo answered."""
    run_dir_parent: str = ""
    """When the run dir does not exist here: its nearest existing parent ('/' for a path none of whose folders
    exist here); '' when it exists."""
    workdir_fs: str = ""
    """Filesystem type of the job's working directory."""
    module_file: str = ""
    """The file of a module:Class experiment found in the job's working directory ('' when none is there)."""
    data_dirs: tuple[str, ...] = ()
    """The shard folders the training reads (the experiment's shard_dirs), absolute."""
    data_fs: str = ""
    """Filesystem type of the first of them; '' if unknown."""
    data_bytes: int = 0
    """Bytes of their shards, from their manifests; 0 if unknown (no manifest here)."""
    stage_free: int = -1
    """Free bytes in data.stage_dir as seen here; -1 where that cannot be known here (a $VARIABLE set per node or
    job, a folder that exists only on the compute nodes)."""
    stage_fs: str = ""
    """Filesystem type of data.stage_dir where it exists here; '' otherwise."""
    train_shards: int = 0
    """Shards of the training split (the first shard folder), from its manifest; 0 if unknown."""
    train_bytes: int = 0
    """Their bytes."""
    max_array_size: int = 0
    """The cluster's MaxArraySize (a job array's indices must stay below it); 0 if unknown or not asked (one run)."""
    script_file: str = ""
    """A script job's file as the job finds it (absolute, relative paths from the job's working directory); '' for
    an experiment or a module."""
    script_problem: str = ""
    """Why the job could not run the script from here ('' when it could): 'missing', 'directory', or the error of
    reading it; for a module, 'missing' when no module of that name is found."""
    script_fs: str = ""
    """Filesystem type of the script's folder."""


def partition_nodes(partition: str) -> tuple[tuple[NodeFacts, ...], str]:
    """Node types of a partition from sinfo (CPUs, GPUs from gres, memory, count), and why they are unknown when
    they are (no sinfo here, a controller sinfo cannot reach, a partition it does not know)."""
    if shutil.which("sinfo") is None:
        return (), "no sinfo on this machine"
    args = ["sinfo", "--noheader", "--format=%c|%G|%m|%D"] + ([f"--partition={partition}"] if partition else [])
    try:
        proc = subprocess.run(args, capture_output=True, text=True, timeout=20)
    except subprocess.TimeoutExpired:
        return (), "sinfo did not answer within 20 s (is the controller reachable?)"
    except OSError as err:
        return (), f"sinfo could not run: {err}"
    if proc.returncode != 0:
        said = (proc.stderr.strip().splitlines() or ["no message"])[0][:200]
        return (), f"sinfo failed: {said}"
    nodes = []
    for line in proc.stdout.splitlines():
        try:
            cpus, gres, mem, count = line.strip().split("|")
            nodes.append(NodeFacts(int(cpus), gres_gpus(gres), int(mem.rstrip("+")), int(count)))
        except ValueError:
            continue
    return tuple(nodes), "" if nodes else f"sinfo lists no nodes for {partition or 'the default partition'}"


def gres_gpus(gres: str) -> int:
    """GPUs in a gres string like 'gpu:a100:4(S:0-1),shard:8' (0 for '(null)')."""
    total = 0
    for item in gres.split(","):
        item = item.split("(")[0]
        parts = item.split(":")
        if parts[0] == "gpu" and len(parts) >= 2 and parts[-1].isdigit():
            total += int(parts[-1])
    return total


def gather_facts(cfg: RunConfig, spec: JobSpec, shard_dirs: Sequence[str]) -> Facts:
    """What the job needs, as seen here. ``shard_dirs``: the folders of shards the experiment reads (its
    shard_dirs(); the command resolves the experiment, which this layer does not import)."""
    s = cfg.slurm
    paths = [p for p in (spec.python, spec.venv, s.container) if p]
    nodes, note = partition_nodes(s.partition)
    return Facts(
        run_dir_fs=filesystem_type(Path(spec.run_dir)),
        run_dir_parent=_nearest_existing(Path(spec.run_dir)),
        workdir_fs=filesystem_type(Path(spec.workdir)),
        module_file=_module_file(cfg.experiment, Path(spec.workdir)),
        partition_note=note,
        # a bare name (slurm.python=python3) counts when it is on PATH here
        existing=frozenset(p for p in paths if Path(p).exists() or ("/" not in p and shutil.which(p))),
        commands=frozenset(c for c in (s.container_runtime,) if shutil.which(c)),
        module_system=module_system_present(),
        nodes=nodes,
        max_array_size=max_array_size() if spec.array is not None else 0,
        **_data_facts(cfg, Path(spec.workdir), shard_dirs),
        **_script_facts(cfg, Path(spec.workdir)),
    )


def _script_facts(cfg: RunConfig, workdir: Path) -> dict:
    """Where a script job's script is, whether it can be read, on what filesystem; a module, whether it is found
    from the job's working directory or this Python's packages (as the job's python -m finds it)."""
    target = cfg.script
    if target is None:
        return {}
    if target.module:
        top = target.module.split(".")[0]
        here = workdir / top
        found = here.with_suffix(".py").is_file() or (here / "__init__.py").is_file() or _importable(top)
        return {"script_problem": "" if found else "missing"}
    path = workdir / target.path  # an absolute path stays as it is
    return {"script_file": str(path), "script_problem": file_problem(path),
            "script_fs": filesystem_type(path.parent) if path.parent.exists() else ""}


def file_problem(path: Path) -> str:
    """Why a script cannot be run from ``path``: 'missing', 'directory', or the error of reading it ('' for none)."""
    if not path.exists():
        return "missing"
    if path.is_dir():
        return "directory"
    try:
        with open(path, "rb") as f:
            f.read(1)
    except OSError as err:
        return err.strerror or str(err)
    return ""


def _importable(module: str) -> bool:
    import importlib.util

    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def max_array_size() -> int:
    """MaxArraySize from `scontrol show config`; 0 when it cannot be asked here."""
    if shutil.which("scontrol") is None:
        return 0
    try:
        proc = subprocess.run(["scontrol", "show", "config"], capture_output=True, text=True, timeout=20)
    except (subprocess.TimeoutExpired, OSError):
        return 0
    found = re.search(r"^MaxArraySize\s*=\s*(\d+)", proc.stdout, re.MULTILINE)
    return int(found.group(1)) if found else 0


def _nearest_existing(path: Path) -> str:
    """'' when ``path`` exists; else its nearest existing parent."""
    path = path.absolute()
    if path.exists():
        return ""
    while not path.exists():
        path = path.parent
    return str(path)


def _module_file(experiment: str, workdir: Path) -> str:
    """For a module:Class experiment, its module's file when the working directory holds it (as the job's
    `python -m hpctrain` finds it there); '' for a built-in experiment or a module found elsewhere."""
    if ":" not in experiment or is_script(experiment):
        return ""
    parts = experiment.split(":", 1)[0].split(".")
    for candidate in (workdir.joinpath(*parts).with_suffix(".py"), workdir.joinpath(*parts, "__init__.py")):
        if candidate.is_file():
            return str(candidate)
    return ""


def _data_facts(cfg: RunConfig, workdir: Path, shard_dirs: Sequence[str]) -> dict:
    """The shard folders (relative ones from the job's working directory), their size and filesystem, and the
    stage dir's room where it can be seen from here."""
    dirs = [workdir / d for d in shard_dirs]
    shards = [_manifest_shards(d) for d in dirs]  # each manifest read once
    train = shards[0] if shards else []
    stage = _stage_dir_here(cfg.data.stage_dir)
    visible = stage is not None and stage.is_dir()
    return {"data_dirs": tuple(str(d) for d in dirs), "data_fs": filesystem_type(dirs[0]) if dirs else "",
            "data_bytes": sum(int(s["bytes"]) for split in shards for s in split),
            "train_shards": len(train), "train_bytes": sum(int(s["bytes"]) for s in train),
            "stage_free": free_bytes(stage) if visible else -1, "stage_fs": filesystem_type(stage) if visible else ""}


def _stage_dir_here(stage_dir: str) -> Path | None:
    """data.stage_dir as a path here, where that means the same folder as on the compute nodes: not when it names
    a variable set per node and job ($TMPDIR, $SLURM_*), or one unset here."""
    if not stage_dir or PER_JOB_VARIABLE.search(stage_dir):
        return None
    try:
        return Path(expand_path(stage_dir, "data.stage_dir"))
    except UserError:
        return None


def _manifest_shards(split_dir: Path) -> list[dict]:
    try:
        shards = json.loads((split_dir / MANIFEST).read_text())["shards"]
        return [s for s in shards if int(s["bytes"]) >= 0]
    except (OSError, ValueError, KeyError, TypeError):  # not here, or not a finished set: nothing to say
        return []
