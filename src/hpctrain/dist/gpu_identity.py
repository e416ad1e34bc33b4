"""Which physical device each process of the job computes on, compared across nodes before the process group exists.

NCCL refuses two ranks of one communicator on one GPU ("Duplicate GPU detected"). Whether a node's processes share a
GPU cannot be read from variables: Slurm sets CUDA_VISIBLE_DEVICES=0 in every task of a one-GPU node with or without
per-task binding, sites differ, and a torchrun under salloc inherits one value for all its workers. So every rank
publishes its device (the GPU's UUID, NVML's identity of the physical GPU whatever index a process sees it under, or
'cpu') in the rendezvous store and reads what the others found; the backend is chosen from that, the same on every
rank, and the log or the error says it. A job whose ranks are not all on GPUs or all on CPUs (a GPU that failed to
initialise on one node) is refused on every rank with where, instead of NCCL and gloo ranks waiting for each other.
torch.distributed has no such check of its own: NCCL finds a duplicate only inside its first communicator, as a crash.
"""

from __future__ import annotations

import datetime
import json
import os
import time
from dataclasses import dataclass

import torch

from hpctrain.dist.env import LaunchInfo
from hpctrain.errors import UserError

CPU = "cpu"


def device_identity(device: torch.device) -> str:
    """The physical GPU's UUID (torch reports NVML's), e.g. 'GPU-6f1c...', or 'cpu'."""
    if device.type != "cuda":
        return CPU
    uuid = str(torch.cuda.get_device_properties(device).uuid)
    return uuid if uuid.startswith("GPU-") else f"GPU-{uuid}"


@dataclass(frozen=True)
class NodeDevices:
    """What a node's local ranks found: each one's device, in local-rank order."""

    host: str
    devices: tuple[str, ...]

    @property
    def kind(self) -> str:
        kinds = {CPU if d == CPU else "cuda" for d in self.devices}
        return kinds.pop() if len(kinds) == 1 else "mixed"

    @property
    def shared(self) -> dict[str, list[int]]:
        """UUID -> the local ranks that use it, for GPUs used by more than one rank."""
        users: dict[str, list[int]] = {}
        for local_rank, device in enumerate(self.devices):
            if device != CPU:
                users.setdefault(device, []).append(local_rank)
        return {uuid: ranks for uuid, ranks in users.items() if len(ranks) > 1}

    def verdict(self) -> dict[str, str]:
        """{'kind': cpu | cuda | mixed, 'shared': '' or e.g. 'on node n1, local ranks 0, 1 use the same GPU
        (GPU-6f1c2a3b) (CUDA_VISIBLE_DEVICES=0 there)', 'host': ...}."""
        shared = ""
        if self.shared:
            parts = [f"local ranks {', '.join(map(str, ranks))} use the same GPU ({uuid[:12]})"
                     for uuid, ranks in self.shared.items()]
            visible = os.environ.get("CUDA_VISIBLE_DEVICES")
            where = f" (CUDA_VISIBLE_DEVICES={visible} there)" if visible is not None else ""
            shared = f"on node {self.host}, " + "; ".join(parts) + where
        cpu_ranks = [str(i) for i, d in enumerate(self.devices) if d == CPU]
        return {"kind": self.kind, "shared": shared, "host": self.host, "cpu_ranks": ", ".join(cpu_ranks)}


def exchange(store, launch: LaunchInfo, mine: str, timeout_s: float) -> list[dict[str, str]]:
    """Collective over every rank (each calls it once): every node's verdict, in node order. Two levels, so a rank
    reads local_world_size + num_nodes keys, not world_size (512 ranks on 64 nodes: 72 reads each): each node's local
    rank 0 publishes its node's verdict. Keys are per torchrun restart, so an elastic restart on the same store never
    reads stale ones. A store wait that times out (a rank that never got here) is a UserError naming what is missing."""
    prefix = f"hpctrain/devices/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"
    store.set(f"{prefix}/node{launch.node_rank}/{launch.local_rank}", mine)
    keys = [f"{prefix}/node{launch.node_rank}/{i}" for i in range(launch.local_world_size)]
    _wait(store, keys, timeout_s, f"local ranks of node {launch.hostname} (node {launch.node_rank})")
    node = NodeDevices(launch.hostname, tuple(store.get(k).decode() for k in keys))
    if launch.local_rank == 0:
        store.set(f"{prefix}/verdict/{launch.node_rank}", json.dumps(node.verdict()))
    verdicts = [f"{prefix}/verdict/{n}" for n in range(launch.num_nodes)]
    _wait(store, verdicts, timeout_s, "nodes")
    found = [json.loads(store.get(k).decode()) for k in verdicts]
    # Rank 0 hosts the store under srun (tcp://): it stays until every rank has read, so that a refusal all ranks
    # raise reaches each of them as the message, not as a lost connection to a store that went away.
    store.add(f"{prefix}/read", 1)
    if launch.rank == 0:
        _wait_count(store, f"{prefix}/read", launch.world_size, timeout_s)
    return found


def _wait_count(store, key: str, count: int, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while store.add(key, 0) < count and time.monotonic() < deadline:
        time.sleep(0.01)


def _wait(store, keys: list[str], timeout_s: float, what: str) -> None:
    try:
        store.wait(keys, datetime.timedelta(seconds=timeout_s))
    except Exception as err:  # DistStoreError (torch >= 2.4) or RuntimeError: a timeout, or the store's host left
        missing = [k.rsplit("/", 1)[1] for k in keys if not store.check([k])]
        raise UserError(
            f"the {what} did not all report their device within dist.timeout_s={timeout_s:g} s (missing: "
            f"{', '.join(missing) or 'none'}; {type(err).__name__}: {str(err).splitlines()[0][:200]})",
            "a process of the job failed before the process group was made: its messages are in the job's log.",
        ) from None


def shared_gpus(store, launch: LaunchInfo, device: torch.device, timeout_s: float) -> list[str]:
    """Collective over every rank of a multi-process job: one line per node whose ranks share a GPU (empty when every
    rank has its own, or on CPUs). The same list on every rank, so every rank chooses the same backend. A job with
    GPU and CPU ranks is refused on every rank with where the CPU ones are."""
    verdicts = exchange(store, launch, device_identity(device), timeout_s)
    kinds = {v["kind"] for v in verdicts}
    if len(kinds) > 1:
        on_cpu = [f"{v['host']} (local ranks {v['cpu_ranks']})" for v in verdicts if v["cpu_ranks"]]
        raise UserError(
            f"some processes of this job compute on a GPU and others on the CPU: on the CPU are {'; '.join(on_cpu)}",
            "every process needs a GPU of its own, or none: check the failing node's GPUs (nvidia-smi) and the job's "
            "GPU request (--gpus-per-node, --gres), or run on CPU nodes only.")
    return [v["shared"] for v in verdicts if v["shared"]]
