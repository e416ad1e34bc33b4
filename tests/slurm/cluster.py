"""A real two-node Slurm cluster on this machine, for tests (see ../shared/notes/slurm-in-a-box.md).

slurmctld runs in the root network namespace; each slurmd runs in a network namespace of
its own (joined to a bridge by a veth pair, no default route: nothing leaves the machine),
with its own hostname and hosts file. Every daemon runs in the foreground as our child,
so teardown stops exactly the processes this fixture started, by pid, and then whatever
is left inside the namespaces it created (jobs). Teardown runs even when setup fails.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

PREFIX = "hpct"  # names of everything we create: bridge hpctbr0, namespaces hpctn1.., veths hpctv1..
SUBNET = "10.77.0"
NODES = ("node1", "node2")
NEEDED = ("slurmctld", "slurmd", "sbatch", "scontrol", "munged", "ip", "nsenter", "unshare")


def why_not_available() -> str:
    """'' when this machine can run the cluster, otherwise the reason to skip."""
    if os.geteuid() != 0:
        return "the Slurm cluster tests need root (network namespaces, daemons)"
    missing = [c for c in NEEDED if shutil.which(c) is None and not Path("/usr/sbin", c).exists()]
    if missing:
        return (f"Slurm is not installed ({', '.join(missing)} missing): "
                "apt-get install slurmd slurmctld slurm-client munge (make test does this as root)")
    probe = subprocess.run(["ip", "netns", "add", f"{PREFIX}probe"], capture_output=True, text=True)
    subprocess.run(["ip", "netns", "delete", f"{PREFIX}probe"], capture_output=True)
    if probe.returncode != 0:
        return f"network namespaces are not available here: {probe.stderr.strip()}"
    return ""


def _sbin(name: str) -> str:
    return shutil.which(name) or f"/usr/sbin/{name}"


def _run(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(list(args), capture_output=True, text=True, check=check)


@dataclass
class Cluster:
    base: Path
    env: dict[str, str] = field(default_factory=dict)
    procs: list[subprocess.Popen] = field(default_factory=list)
    namespaces: list[str] = field(default_factory=list)
    links: list[str] = field(default_factory=list)
    munged_pid: int | None = None

    @property
    def conf(self) -> Path:
        return self.base / "slurm.conf"

    # --- commands against this cluster ---
    def run(self, *args: str, timeout: float = 30) -> subprocess.CompletedProcess:
        return subprocess.run(list(args), capture_output=True, text=True, env=self.env, timeout=timeout)

    def job(self, job_id: str) -> dict[str, str]:
        from hpctrain.slurm.job import parse_scontrol_fields

        return parse_scontrol_fields(self.run("scontrol", "show", "job", "--oneliner", job_id).stdout)

    def wait_job(self, job_id: str, states: tuple[str, ...], timeout: float) -> dict[str, str]:
        deadline = time.monotonic() + timeout
        fields: dict[str, str] = {}
        while time.monotonic() < deadline:
            fields = self.job(job_id)
            if fields.get("JobState") in states:
                return fields
            time.sleep(0.5)
        raise AssertionError(f"job {job_id} not in {states} after {timeout} s: {fields}")

    # --- lifecycle ---
    def start(self) -> None:
        self.base.mkdir(parents=True, exist_ok=True)
        self.env = {**os.environ, "SLURM_CONF": str(self.conf)}
        self._cleanup_leftovers()
        self._start_munge()
        self._network()
        self._write_config()
        self.procs.append(subprocess.Popen(
            [_sbin("slurmctld"), "-D", "-f", str(self.conf)],
            stdout=open(self.base / "slurmctld.out", "wb"), stderr=subprocess.STDOUT, env=self.env))
        for i, node in enumerate(NODES, 1):
            (self.base / "spool" / node).mkdir(parents=True, exist_ok=True)
            hosts = self.base / "hosts"
            self.procs.append(subprocess.Popen(
                ["nsenter", f"--net=/run/netns/{PREFIX}n{i}", "unshare", "--uts", "--mount", "sh", "-c",
                 f"hostname {node} && mount --bind {hosts} /etc/hosts && exec {_sbin('slurmd')} -D -N {node}"],
                stdout=open(self.base / f"slurmd_{node}.out", "wb"), stderr=subprocess.STDOUT, env=self.env))
        self._wait_idle(timeout=60)

    def _cleanup_leftovers(self) -> None:
        """Namespaces and links of an earlier run of this fixture that was killed before its teardown."""
        for i in range(1, len(NODES) + 1):
            ns = f"{PREFIX}n{i}"
            if Path(f"/run/netns/{ns}").exists():
                self._kill_namespace_processes(ns)
                _run("ip", "netns", "delete", ns, check=False)
            _run("ip", "link", "delete", f"{PREFIX}v{i}", check=False)
        _run("ip", "link", "delete", f"{PREFIX}br0", check=False)

    def _start_munge(self) -> None:
        if Path("/run/munge/munge.socket.2").exists() and _run("munge", "-n", check=False).returncode == 0:
            return  # a munged is already serving; it is not ours to stop
        Path("/run/munge").mkdir(parents=True, exist_ok=True)
        shutil.chown("/run/munge", "munge", "munge")
        _run("runuser", "-u", "munge", "--", _sbin("munged"))
        for _ in range(50):
            pid_file = Path("/run/munge/munged.pid")
            if pid_file.exists() and pid_file.read_text().strip():
                self.munged_pid = int(pid_file.read_text())
                return
            time.sleep(0.1)
        raise RuntimeError("munged did not start")

    def _network(self) -> None:
        bridge = f"{PREFIX}br0"
        _run("ip", "link", "add", bridge, "type", "bridge")
        self.links.append(bridge)
        _run("ip", "addr", "add", f"{SUBNET}.1/24", "dev", bridge)
        _run("ip", "link", "set", bridge, "up")
        for i in range(1, len(NODES) + 1):
            ns, veth = f"{PREFIX}n{i}", f"{PREFIX}v{i}"
            _run("ip", "netns", "add", ns)
            self.namespaces.append(ns)
            _run("ip", "link", "add", veth, "type", "veth", "peer", "name", f"{veth}p")
            self.links.append(veth)
            _run("ip", "link", "set", f"{veth}p", "netns", ns)
            _run("ip", "link", "set", veth, "master", bridge)
            _run("ip", "link", "set", veth, "up")
            _run("ip", "-n", ns, "addr", "add", f"{SUBNET}.{10 + i}/24", "dev", f"{veth}p")
            _run("ip", "-n", ns, "link", "set", f"{veth}p", "up")
            _run("ip", "-n", ns, "link", "set", "lo", "up")
        lines = ["127.0.0.1 localhost", f"{SUBNET}.1 {socket.gethostname()} slurmctl"]
        for i, node in enumerate(NODES, 1):
            # the v4-mapped form too: c10d looks up the peer of an IPv6 socket
            lines += [f"{SUBNET}.{10 + i} {node}", f"::ffff:{SUBNET}.{10 + i} {node}"]
        (self.base / "hosts").write_text("\n".join(lines) + "\n")

    def _write_config(self) -> None:
        cpus = os.cpu_count() or 2
        b = self.base
        nodes = "\n".join(f"NodeName={n} NodeAddr={SUBNET}.{10 + i} CPUs={cpus} RealMemory=4000 State=UNKNOWN"
                          for i, n in enumerate(NODES, 1))
        self.conf.write_text(f"""\
ClusterName=hpct
SlurmctldHost={socket.gethostname().split('.')[0]}({SUBNET}.1)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=cred_expire=10
StateSaveLocation={b}/state
SlurmdSpoolDir={b}/spool/%n
SlurmctldPidFile={b}/slurmctld.pid
SlurmdPidFile={b}/slurmd_%n.pid
SlurmctldLogFile={b}/slurmctld.log
SlurmdLogFile={b}/slurmd_%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/linux
JobAcctGatherFrequency=1
JobCompType=jobcomp/filetxt
JobCompLoc={b}/jobcomp.txt
SelectType=select/cons_tres
SelectTypeParameters=CR_Core_Memory
DefMemPerCPU=500
SchedulerParameters=sched_interval=5
KillWait=10
MpiDefault=none
ReturnToService=2
MinJobAge=600
{nodes}
PartitionName=main Nodes={','.join(NODES)} Default=YES MaxTime=INFINITE State=UP
""")
        (b / "state").mkdir(exist_ok=True)

    def _wait_idle(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        out = ""
        while time.monotonic() < deadline:
            for proc in self.procs:
                if proc.poll() is not None:
                    raise RuntimeError(f"a Slurm daemon exited ({proc.args}); logs in {self.base}")
            out = self.run("sinfo", "--noheader", "--format=%n %T").stdout
            states = dict(line.split() for line in out.splitlines() if len(line.split()) == 2)
            if all(states.get(n) == "idle" for n in NODES):
                return
            time.sleep(0.5)
        raise RuntimeError(f"nodes not idle after {timeout} s: {out!r}; logs in {self.base}")

    def stop(self) -> None:
        """Cancel jobs, stop our daemons by pid, end what is left in our namespaces, delete the network."""
        try:
            if self.procs and self.procs[0].poll() is None:
                self.run("scancel", "--full", "--partition=main", timeout=10)
        except (OSError, subprocess.TimeoutExpired):
            pass
        for proc in reversed(self.procs):
            if proc.poll() is None:
                proc.terminate()
        for proc in reversed(self.procs):
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=5)
        for ns in self.namespaces:
            self._kill_namespace_processes(ns)
            _run("ip", "netns", "delete", ns, check=False)
        for link in reversed(self.links):
            _run("ip", "link", "delete", link, check=False)
        if self.munged_pid:
            try:
                os.kill(self.munged_pid, signal.SIGTERM)
            except ProcessLookupError:
                pass

    @staticmethod
    def _kill_namespace_processes(ns: str) -> None:
        pids = _run("ip", "netns", "pids", ns, check=False).stdout.split()
        for pid in pids:
            try:
                os.kill(int(pid), signal.SIGKILL)
            except (ProcessLookupError, ValueError):
                pass
