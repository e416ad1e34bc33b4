"""Launch detection: the one module that reads os.environ for launch and cluster facts.

Three launch modes are recognised, most specific first:

- ``torchrun``: RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, GROUP_RANK, MASTER_ADDR, MASTER_PORT. It wins even
  inside a Slurm job, where srun's SLURM_* variables describe the one launcher task per node, not the workers.
- ``srun`` one task per GPU: SLURM_PROCID / SLURM_LOCALID / SLURM_STEP_NUM_TASKS, master = first host of the step's
  node list. We require the *step* variables that only srun sets: the batch script itself also has SLURM_PROCID=0
  and SLURM_NTASKS, and treating it as rank 0 of NTASKS would wait forever for ranks that never come.
- ``single``: one plain process.

Like submitit, each variable maps to a named field through a table, so what we read is listed in one place.
"""

from __future__ import annotations

import contextlib
import os
import re
import socket
from dataclasses import dataclass
from typing import Iterator, Literal, Mapping

from hpctrain.config.validate import ALERT_WEBHOOK  # config (a layer below) checks slurm.env for it
from hpctrain.errors import UserError

TORCHRUN_VARS = {
    "rank": "RANK",
    "local_rank": "LOCAL_RANK",
    "world_size": "WORLD_SIZE",
    "local_world_size": "LOCAL_WORLD_SIZE",
    "node_rank": "GROUP_RANK",
    "num_nodes": "GROUP_WORLD_SIZE",
    "master_addr": "MASTER_ADDR",
    "master_port": "MASTER_PORT",
}
SRUN_VARS = {
    "rank": "SLURM_PROCID",
    "local_rank": "SLURM_LOCALID",
    "world_size": "SLURM_STEP_NUM_TASKS",
    "node_rank": "SLURM_NODEID",
    "num_nodes": "SLURM_STEP_NUM_NODES",
    "nodelist": "SLURM_STEP_NODELIST",
    "tasks_per_node": "SLURM_STEP_TASKS_PER_NODE",
}
SLURM_JOB_ID = "SLURM_JOB_ID"
# Rendezvous port from the job id (srun mode without MASTER_PORT, and the rendered job script), so two jobs on
# a node differ: PORT_BASE + id % PORT_SPAN stays below Linux's ephemeral ports (32768 up), which the OS hands
# out to outgoing connections and could already be taken.
PORT_BASE = 15000
PORT_SPAN = 15000


def job_port(job_id: str) -> int:
    return PORT_BASE + int(job_id or 0) % PORT_SPAN


@dataclass(frozen=True)
class LaunchInfo:
    launcher: Literal["torchrun", "srun", "single"]
    """Who started this process."""
    rank: int
    """Global rank."""
    local_rank: int
    """Rank on this node; selects the GPU."""
    world_size: int
    """Number of processes in the job."""
    local_world_size: int
    """Processes on this node."""
    node_rank: int
    """Index of this node among the job's nodes."""
    num_nodes: int
    """Number of nodes."""
    master_addr: str
    """Rendezvous host (rank 0's node)."""
    master_port: int
    """Rendezvous port."""
    hostname: str
    """This node's hostname."""
    job_id: str
    """Slurm job id, or '' outside Slurm."""


def requeue_id(environ: Mapping[str, str] | None = None) -> str:
    """What `scontrol requeue` must be given for this job: in a job array ARRAY_TASK (e.g. 812_3), never the job id
    alone: the last task to start carries the array's own id, and requeueing that id requeues every task of the
    array (Slurm's job_requeue takes it for the whole array): running points killed, finished ones queued again."""
    env = os.environ if environ is None else environ
    array, task = env.get("SLURM_ARRAY_JOB_ID", ""), env.get("SLURM_ARRAY_TASK_ID", "")
    return f"{array}_{task}" if array and task else env.get(SLURM_JOB_ID, "")


def restart_count(environ: Mapping[str, str] | None = None) -> int:
    """SLURM_RESTART_COUNT: how often Slurm requeued this job (0 outside Slurm, and at its first start)."""
    value = (os.environ if environ is None else environ).get("SLURM_RESTART_COUNT", "")
    return int(value) if value.isdigit() else 0


def detect_launch(environ: Mapping[str, str] | None = None) -> LaunchInfo:
    env = os.environ if environ is None else environ
    host = socket.gethostname()
    job_id = env.get(SLURM_JOB_ID, "")
    if "RANK" in env and "WORLD_SIZE" in env and "LOCAL_RANK" in env:
        return _from_torchrun(env, host, job_id)
    if "SLURM_PROCID" in env and "SLURM_STEP_NUM_TASKS" in env:
        return _from_srun(env, host, job_id)
    return LaunchInfo("single", 0, 0, 1, 1, 0, 1, "127.0.0.1", 29500, host, job_id)


def _int(env: Mapping[str, str], name: str) -> int:
    try:
        return int(env[name])
    except KeyError:
        raise UserError(f"environment variable {name} is missing", _mixed_env_hint()) from None
    except ValueError:
        raise UserError(f"environment variable {name}={env[name]!r} is not an integer", _mixed_env_hint()) from None


def _mixed_env_hint() -> str:
    return (
        "launch with torchrun (which sets RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT) or with "
        "srun one task per GPU; do not export a partial set of these variables yourself."
    )


def _from_torchrun(env: Mapping[str, str], host: str, job_id: str) -> LaunchInfo:
    v = TORCHRUN_VARS
    world = _int(env, v["world_size"])
    local_world = int(env.get(v["local_world_size"], world))
    return LaunchInfo(
        launcher="torchrun",
        rank=_int(env, v["rank"]),
        local_rank=_int(env, v["local_rank"]),
        world_size=world,
        local_world_size=local_world,
        node_rank=int(env.get(v["node_rank"], 0)),
        # torchrun says how many agents (nodes) there are; world / local world is wrong when nodes run different
        # numbers of processes
        num_nodes=int(env.get(v["num_nodes"], max(1, world // max(1, local_world)))),
        master_addr=env.get(v["master_addr"], "127.0.0.1"),
        master_port=int(env.get(v["master_port"], 29500)),
        hostname=host,
        job_id=job_id,
    )


def _from_srun(env: Mapping[str, str], host: str, job_id: str) -> LaunchInfo:
    v = SRUN_VARS
    world = _int(env, v["world_size"])
    nodelist = env.get(v["nodelist"]) or env.get("SLURM_JOB_NODELIST", "")
    hosts = expand_nodelist(nodelist) if nodelist else [host]
    num_nodes = int(env.get(v["num_nodes"], len(hosts)))
    tasks = parse_tasks_per_node(env.get(v["tasks_per_node"], ""))
    node_rank = _int(env, v["node_rank"])
    local_world = tasks[node_rank] if node_rank < len(tasks) else max(1, world // num_nodes)
    port = env.get("MASTER_PORT") or str(job_port(job_id))
    return LaunchInfo(
        launcher="srun",
        rank=_int(env, "SLURM_PROCID"),
        local_rank=_int(env, "SLURM_LOCALID"),
        world_size=world,
        local_world_size=local_world,
        node_rank=node_rank,
        num_nodes=num_nodes,
        master_addr=env.get("MASTER_ADDR") or hosts[0],
        master_port=int(port),
        hostname=host,
        job_id=job_id,
    )


_RANGE = re.compile(r"^(\d+)(?:-(\d+))?$")


def expand_nodelist(nodelist: str) -> list[str]:
    """Slurm's compressed host list ('gpu[01-03,07],login1') to host names, in order.

    What ``scontrol show hostnames`` prints; done here so that it works in a
    process that cannot run scontrol (a container, a unit test).
    """
    hosts: list[str] = []
    for item in _split_top_level(nodelist):
        hosts.extend(_expand_item(item))
    return hosts


def _split_top_level(text: str) -> list[str]:
    items, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        depth += ch == "["
        depth -= ch == "]"
        if ch == "," and depth == 0:
            items.append(text[start:i])
            start = i + 1
    items.append(text[start:])
    return [i.strip() for i in items if i.strip()]


def _expand_item(item: str) -> list[str]:
    open_at = item.find("[")
    if open_at < 0:
        return [item]
    close_at = item.index("]", open_at)
    prefix, ranges, rest = item[:open_at], item[open_at + 1 : close_at], item[close_at + 1 :]
    tails = _expand_item(rest) if rest else [""]
    out = []
    for part in ranges.split(","):
        m = _RANGE.match(part.strip())
        if not m:
            raise UserError(f"cannot read the Slurm node list entry '{item}'", "check SLURM_JOB_NODELIST.")
        lo, hi = m.group(1), m.group(2) or m.group(1)
        for n in range(int(lo), int(hi) + 1):
            out.extend(f"{prefix}{str(n).zfill(len(lo))}{tail}" for tail in tails)
    return out


def parse_tasks_per_node(text: str) -> list[int]:
    """SLURM_STEP_TASKS_PER_NODE ('2(x3),1') to one count per node."""
    counts: list[int] = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        m = re.match(r"^(\d+)(?:\(x(\d+)\))?$", part)
        if not m:
            return []
        counts.extend([int(m.group(1))] * int(m.group(2) or 1))
    return counts


FAULT_INJECTION = "HPCTRAIN_FAULT"
UNDER_AGENT = "HPCTRAIN_AGENT"  # set by hpctrain's torchrun wrapper for its workers


def alert_webhook_url(environ: Mapping[str, str] | None = None) -> str:
    """The alert webhook from the environment ('' when unset). Never log it: it is a credential."""
    return (os.environ if environ is None else environ).get(ALERT_WEBHOOK, "").strip()


def fault_injection_spec(environ: Mapping[str, str] | None = None) -> str:
    """Test-only fault injection (see fault/inject.py); '' in normal runs."""
    return (os.environ if environ is None else environ).get(FAULT_INJECTION, "")


def nccl_ifname_matches(value: str, interfaces: list[str]) -> list[str]:
    """The interfaces NCCL_SOCKET_IFNAME=value selects: prefixes by default, '=' for exact names, '^' to exclude
    (NCCL's rules)."""
    exclude, exact = value.startswith("^"), value.lstrip("^").startswith("=")
    names = [n for n in value.lstrip("^").lstrip("=").split(",") if n]

    def hit(iface: str) -> bool:
        return any(iface == n if exact else iface.startswith(n) for n in names)

    return [i for i in interfaces if hit(i) != exclude]


def gloo_ifname_from_nccl(environ: Mapping[str, str] | None = None, addresses: Mapping[str, str] | None = None) -> str:
    """The one interface gloo (hpctrain's control plane) should use, from NCCL_SOCKET_IFNAME, when the user set
    that but not GLOO_SOCKET_IFNAME: gloo takes exact names only (no prefixes, no '^'), and without one it binds
    to whatever the hostname resolves to (127.0.1.1 on many images), which other nodes cannot reach.
    As NCCL does, only interfaces with an address count, in the kernel's order; among several, the one this node
    routes MASTER_ADDR through (a Docker or libvirt bridge also matches '^docker0,lo', with the same address on
    every node). '' when there is nothing to derive: gloo then chooses as always."""
    env = os.environ if environ is None else environ
    value = env.get("NCCL_SOCKET_IFNAME", "")
    if not value or env.get("GLOO_SOCKET_IFNAME"):
        return ""
    have = interface_addresses() if addresses is None else addresses
    usable = [i for i in nccl_ifname_matches(value, list(have)) if not have[i].startswith("127.")]
    route = _source_address(env.get("MASTER_ADDR", ""))
    preferred = [i for i in usable if have[i] == route]
    return (preferred or usable or [""])[0]


def interface_addresses() -> dict[str, str]:
    """IPv4 address of each interface that has one, in the kernel's interface order (Linux SIOCGIFADDR)."""
    import fcntl
    import struct

    found = {}
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            try:
                packed = fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", name.encode()[:15]))  # SIOCGIFADDR
            except OSError:  # down, or no IPv4 address
                continue
            found[name] = socket.inet_ntoa(packed[20:24])
    return found


def _source_address(host: str) -> str:
    """This node's address on the route to host ('' if unknown). A UDP connect only asks the kernel's routing
    table: no packet is sent."""
    if not host:
        return ""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((host, 9))
            return s.getsockname()[0]
    except OSError:
        return ""


def under_hpctrain_agent(environ: Mapping[str, str] | None = None) -> bool:
    """True in workers started by hpctrain's torchrun wrapper, which reports their failures itself."""
    return bool(agent_pid(environ))


def agent_pid(environ: Mapping[str, str] | None = None) -> int:
    """The pid of the hpctrain torchrun wrapper that started this worker (0 if none): the value of the mark."""
    value = (os.environ if environ is None else environ).get(UNDER_AGENT, "")
    return int(value) if value.isdigit() else 0


# What the wrapper and torchrun put into the process's environment for the workers; restored after the launch.
AGENT_VARIABLES = (UNDER_AGENT, "TORCHELASTIC_ERROR_FILE", "TORCHELASTIC_SIGNALS_TO_HANDLE", "OMP_NUM_THREADS")


@contextlib.contextmanager
def agent_environment(error_file: str) -> Iterator[None]:
    """The torchrun wrapper's environment for its workers (they inherit it): the mark that hpctrain's agent (this
    process, by pid) reports their failures, and where torchrun copies a failing worker's error file (unless the
    caller chose one). Restored afterwards, with what torchrun itself sets (OMP_NUM_THREADS, its signal list):
    the wrapper runs inside the command's own process."""
    saved = {name: os.environ.get(name) for name in AGENT_VARIABLES}
    os.environ[UNDER_AGENT] = str(os.getpid())
    os.environ.setdefault("TORCHELASTIC_ERROR_FILE", error_file)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


SCRIPT_SETTINGS = "HPCTRAIN_SETTINGS"
"""Set for every process of a script job (--script): the absolute path of RUN_DIR/settings.toml, the hpctrain
settings the user gave (config/load.settings_toml). hpctrain.session() reads it."""
EXITS_DIR = "HPCTRAIN_EXITS_DIR"
"""Set by a script job's batch shell: where each node's launcher records how its ranks ended (one file per node),
and from which the batch shell decides whether to requeue."""
FORWARD_SIGNALS = "HPCTRAIN_FORWARD_SIGNALS"
"""Set by a script job's batch shell: 0 when Slurm signals every process of the job step itself (ProctrackType
cgroup or linuxproc), so that the node launchers pass no signal on (each rank would get it twice); 1 otherwise."""


def script_settings_path(environ: Mapping[str, str] | None = None) -> str:
    """HPCTRAIN_SETTINGS: the settings file of the script job this process belongs to ('' outside one)."""
    return (os.environ if environ is None else environ).get(SCRIPT_SETTINGS, "")


@contextlib.contextmanager
def script_environment(settings_path: str) -> Iterator[None]:
    """HPCTRAIN_SETTINGS for the workers of a script job launched from this process (they inherit it), restored
    afterwards: the launch runs inside the command's own process."""
    saved = os.environ.get(SCRIPT_SETTINGS)
    os.environ[SCRIPT_SETTINGS] = settings_path
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop(SCRIPT_SETTINGS, None)
        else:
            os.environ[SCRIPT_SETTINGS] = saved


@dataclass(frozen=True, kw_only=True)
class ScriptStep:
    """What a script job's batch shell tells each node's launcher (all defaults outside a Slurm script job)."""

    exits_dir: str = ""
    """Where the node records how its ranks ended ('' when nothing is recorded: a local launch)."""
    forward_signals: bool = True
    """Pass stop signals on to the workers (False where Slurm delivers them to every process itself)."""
    node_id: int = 0
    """This node's index in the step (SLURM_NODEID)."""
    num_nodes: int = 1
    """Nodes of the step, one launcher each."""


def script_step(environ: Mapping[str, str] | None = None) -> ScriptStep:
    """The batch shell's word to this node's launcher of a script job (HPCTRAIN_EXITS_DIR, HPCTRAIN_FORWARD_SIGNALS,
    and srun's SLURM_NODEID and SLURM_STEP_NUM_NODES)."""
    env = os.environ if environ is None else environ

    def number(name: str, default: int) -> int:
        value = env.get(name, "")
        return int(value) if value.isdigit() else default

    return ScriptStep(exits_dir=env.get(EXITS_DIR, ""), forward_signals=env.get(FORWARD_SIGNALS, "1") != "0",
                      node_id=number("SLURM_NODEID", 0),
                      num_nodes=number("SLURM_STEP_NUM_NODES", number("SLURM_NNODES", 1)))


def cpus_available() -> int:
    """CPUs this process may run on (Slurm's cpus-per-task binding shows up in the affinity mask)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        return os.cpu_count() or 1


def stdout_is_terminal() -> bool:
    import sys

    return sys.stdout.isatty() and os.environ.get("TERM", "") != "dumb"


MONITOR_DIR = "HPCTRAIN_MONITOR_DIR"  # set by the rendered job script: where each node's monitors write
MONITOR_EVERY = "HPCTRAIN_MONITOR_EVERY"


def monitor_settings(environ: Mapping[str, str] | None = None) -> tuple[str, int]:
    """(directory, interval in seconds) for the node monitors; ('', 0) when the job did not ask for them."""
    env = os.environ if environ is None else environ
    try:
        every = int(env.get(MONITOR_EVERY, "0"))
    except ValueError:
        every = 0
    directory = env.get(MONITOR_DIR, "")
    return (directory, every) if directory and every > 0 else ("", 0)


def module_system_present(environ: Mapping[str, str] | None = None) -> bool:
    """Environment modules (Lmod or Tcl modules) are set up in this shell."""
    env = os.environ if environ is None else environ
    return bool(env.get("LMOD_CMD") or env.get("MODULESHOME"))


DOCTOR_PREFIXES = ("SLURM_", "NCCL_", "MASTER_", "CUDA_VISIBLE_DEVICES", "OMP_NUM_THREADS")


def launch_variables(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The variables `hpctrain doctor` looks at: SLURM_*, NCCL_*, MASTER_*, torchrun's, CUDA_VISIBLE_DEVICES."""
    env = os.environ if environ is None else environ
    names = set(TORCHRUN_VARS.values())
    return {k: v for k, v in sorted(env.items()) if k in names or k.startswith(DOCTOR_PREFIXES)}


_VARIABLE = re.compile(r"\$(?:(\w+)|\{(\w+)(?::-([^}]*))?\})")  # $VAR, ${VAR}, ${VAR:-default}


def expand_path(value: str, key: str, environ: Mapping[str, str] | None = None) -> str:
    """A config path with ~ and $VARIABLES (also ${VAR:-default}, as in the shell) expanded from this process's
    environment: on the node that uses it, not where the config was written ($TMPDIR and $SLURM_TMPDIR differ per
    node and per job). An unset variable without a default is an error naming it, not a folder literally called
    '$SLURM_TMPDIR'."""
    env = os.environ if environ is None else environ

    def value_of(m: re.Match) -> str:
        name, default = m.group(1) or m.group(2), m.group(3)
        if env.get(name) or (name in env and default is None):
            return env[name]
        if default is not None:
            return default
        raise UserError(f"{key}={value}: the environment variable {name} is not set on {socket.gethostname()}",
                        f"set {key} to a path, to a variable that every node of the job has, or give a default as "
                        f"in the shell: ${{{name}:-/local/scratch}}.")

    return os.path.expanduser(_VARIABLE.sub(value_of, value))


SESSION_SETTINGS = "HPCTRAIN_SETTINGS"
"""A script launched by hpctrain (`hpctrain train|slurm submit --script`): the TOML file of the hpctrain settings its
user gave (--config and key=value), which hpctrain.session() resolves above the script's own defaults."""
RESUME_RECORD = "HPCTRAIN_RESUME_RECORD"
"""`hpctrain check resume`: the folder each rank of the run it checks writes its per-step record into."""


def session_settings(environ: Mapping[str, str] | None = None) -> str:
    """The settings file of a script hpctrain launched ('' when the script was started otherwise)."""
    return (os.environ if environ is None else environ).get(SESSION_SETTINGS, "")


def resume_record_dir(environ: Mapping[str, str] | None = None) -> str:
    """Where `hpctrain check resume` collects this run's per-step records ('' for a run it does not check)."""
    return (os.environ if environ is None else environ).get(RESUME_RECORD, "")


def script_name(argv: list[str] | None = None) -> str:
    """The program a user's loop runs in (sys.argv[0] as given), naming a session started without hpctrain."""
    import sys

    argv = sys.argv if argv is None else argv
    return (argv[0] if argv else "") or "session"
