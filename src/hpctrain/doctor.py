"""The checks of `hpctrain doctor` (commands/doctor.py): can this node's launch environment run a distributed job?

Run it inside an allocation on every node (``srun --ntasks-per-node=1 hpctrain doctor``).
Each check is a pure function of the launch variables plus one probe of this machine
(name resolution, network interfaces, a port), so it is unit-tested with fake inputs.
Bandwidth, GEMM and straggler tests belong to the performance pre-flight and are not here.
"""

from __future__ import annotations

import socket
from dataclasses import dataclass
from typing import Callable, Literal, Mapping

from hpctrain.dist.env import cpus_available, expand_nodelist, launch_variables, nccl_ifname_matches


@dataclass(frozen=True)
class Check:
    name: str
    status: Literal["pass", "warn", "fail", "skip"]
    detail: str

    def format(self, host: str) -> str:
        return f"{host}: {self.status.upper():4s} {self.name}: {self.detail}"


def master_addr(env: Mapping[str, str]) -> str:
    if env.get("MASTER_ADDR"):
        return env["MASTER_ADDR"]
    nodes = expand_nodelist(env.get("SLURM_JOB_NODELIST", "") or env.get("SLURM_NODELIST", ""))
    return nodes[0] if nodes else ""


def check_variables(env: Mapping[str, str]) -> Check:
    torchrun = "RANK" in env and "LOCAL_WORLD_SIZE" in env
    if not env.get("SLURM_JOB_ID"):
        return Check("slurm", "skip", "not inside a Slurm job")
    if torchrun and env.get("SLURM_JOB_NUM_NODES"):
        expected = int(env["SLURM_JOB_NUM_NODES"]) * int(env["LOCAL_WORLD_SIZE"])
        if int(env.get("WORLD_SIZE", "0")) != expected:
            return Check("slurm", "fail", f"WORLD_SIZE={env.get('WORLD_SIZE')} but {env['SLURM_JOB_NUM_NODES']} nodes x "
                         f"LOCAL_WORLD_SIZE={env['LOCAL_WORLD_SIZE']} = {expected}: torchrun's --nnodes does not "
                         "match the allocation")
    tasks = env.get("SLURM_STEP_TASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE", "")
    if torchrun and tasks and tasks.split("(")[0] not in ("1", ""):
        return Check("slurm", "fail", f"{tasks} Slurm tasks per node each run torchrun: use "
                     "--ntasks-per-node=1 (torchrun starts the per-GPU processes)")
    return Check("slurm", "pass", f"job {env['SLURM_JOB_ID']} on {env.get('SLURM_JOB_NODELIST', '?')}")


def check_master(env: Mapping[str, str], resolve: Callable[[str], str]) -> Check:
    addr = master_addr(env)
    if not addr:
        return Check("master address", "skip", "no MASTER_ADDR and no Slurm node list")
    try:
        return Check("master address", "pass", f"{addr} resolves to {resolve(addr)} here")
    except OSError as err:
        return Check("master address", "fail", f"{addr} does not resolve on this node ({err}); the rendezvous will "
                     "hang: ask your admins, or use the node's address that resolves (scontrol show node)")


def check_socket_ifname(env: Mapping[str, str], interfaces: list[str]) -> Check:
    """NCCL_SOCKET_IFNAME: prefixes by default, '=' for exact names, '^' to exclude (NCCL's rules)."""
    value = env.get("NCCL_SOCKET_IFNAME", "")
    if not value:
        return Check("NCCL_SOCKET_IFNAME", "skip", f"not set; NCCL chooses among {', '.join(interfaces)}")
    usable = nccl_ifname_matches(value, interfaces)
    if not usable:
        return Check("NCCL_SOCKET_IFNAME", "fail", f"{value!r} matches no interface of this node "
                     f"({', '.join(interfaces)}); NCCL will fail to start")
    return Check("NCCL_SOCKET_IFNAME", "pass", f"{value!r} -> {', '.join(usable)}")


def check_port(env: Mapping[str, str], host: str, bind: Callable[[int], None]) -> Check:
    addr, port = master_addr(env), env.get("MASTER_PORT", "")
    if not port:
        return Check("rendezvous port", "skip", "MASTER_PORT not set")
    if addr and addr.split(".")[0] != host.split(".")[0]:
        return Check("rendezvous port", "skip", f"checked on the master node ({addr})")
    try:
        bind(int(port))
    except OSError as err:
        return Check("rendezvous port", "fail", f"port {port} cannot be bound on {host} ({err.strerror}): another job "
                     "uses it; the generated scripts derive the port from the job id")
    return Check("rendezvous port", "pass", f"port {port} is free on {host}")


def check_cpus(env: Mapping[str, str], cpus: int) -> Check:
    wanted = env.get("SLURM_CPUS_PER_TASK", "")
    if not wanted:
        return Check("cpus", "pass", f"{cpus} CPUs usable by this process")
    if cpus < int(wanted):
        return Check("cpus", "warn", f"{cpus} CPUs usable but SLURM_CPUS_PER_TASK={wanted}: srun did not pass "
                     "--cpus-per-task on (Slurm >= 22.05); set SRUN_CPUS_PER_TASK or srun --cpus-per-task")
    return Check("cpus", "pass", f"{cpus} CPUs usable, SLURM_CPUS_PER_TASK={wanted}")


def _bind(port: int) -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("", port))


def _resolve(name: str) -> str:
    return socket.getaddrinfo(name, None, socket.AF_INET)[0][4][0]


def run_checks(env: Mapping[str, str] | None = None) -> list[Check]:
    env = launch_variables() if env is None else env
    # if_nameindex asks the kernel for this network namespace; /sys/class/net shows the namespace sysfs was
    # mounted in, which differs under nsenter/containers.
    interfaces = sorted(name for _, name in socket.if_nameindex())
    host = socket.gethostname()
    return [
        check_variables(env),
        check_master(env, _resolve),
        check_socket_ifname(env, interfaces),
        check_port(env, host, _bind),
        check_cpus(env, cpus_available()),
    ]

