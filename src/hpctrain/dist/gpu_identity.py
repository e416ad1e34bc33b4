"""Which physical GPU each process of a node computes on, compared across the node before the process group exists.

NCCL refuses two ranks of one communicator on one GPU ("Duplicate GPU detected"). Whether a node's processes share a
GPU cannot be read from variables: Slurm sets CUDA_VISIBLE_DEVICES=0 in every task of a one-GPU node with or without
per-task binding, sites differ, and a torchrun under salloc inherits one value for all its workers. So the node's
ranks publish their device's UUID (NVML's identity of the physical GPU, the same whatever index a process sees it
under) in the rendezvous store and read each other's; the backend is chosen from what they found, and the log or the
error says it. torch.distributed has no such check of its own: NCCL finds the duplicate only inside its first
communicator, as a crash.
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass

import torch

from hpctrain.dist.env import LaunchInfo


def device_uuid(device: torch.device) -> str:
    """The physical GPU's UUID (torch reports NVML's), e.g. 'GPU-6f1c...'."""
    uuid = str(torch.cuda.get_device_properties(device).uuid)
    return uuid if uuid.startswith("GPU-") else f"GPU-{uuid}"


def exchange(store, launch: LaunchInfo, mine: str, timeout_s: float) -> tuple[list[str], list[str]]:
    """Collective over every rank (each calls it once): (the values of this node's local ranks in local-rank order,
    every node's verdict that is not empty). Two levels, so a rank reads local_world_size + num_nodes keys, not
    world_size (512 ranks on 64 nodes: 72 reads each): each node's local rank 0 publishes its node's verdict.
    Keys are per torchrun restart, so an elastic restart on the same store never reads stale ones."""
    prefix = f"hpctrain/gpu-uuid/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"
    timeout = datetime.timedelta(seconds=timeout_s)
    store.set(f"{prefix}/node{launch.node_rank}/{launch.local_rank}", mine)
    keys = [f"{prefix}/node{launch.node_rank}/{i}" for i in range(launch.local_world_size)]
    store.wait(keys, timeout)
    node = [store.get(k).decode() for k in keys]
    if launch.local_rank == 0:
        store.set(f"{prefix}/verdict/{launch.node_rank}", NodeGpus(launch.hostname, tuple(node)).verdict())
    verdicts = [f"{prefix}/verdict/{n}" for n in range(launch.num_nodes)]
    store.wait(verdicts, timeout)
    return node, [text for text in (store.get(k).decode() for k in verdicts) if text]


@dataclass(frozen=True)
class NodeGpus:
    """What a node's local ranks found: each one's GPU UUID, in local-rank order."""

    host: str
    uuids: tuple[str, ...]

    @property
    def shared(self) -> dict[str, list[int]]:
        """UUID -> the local ranks that use it, for GPUs used by more than one rank."""
        users: dict[str, list[int]] = {}
        for local_rank, uuid in enumerate(self.uuids):
            users.setdefault(uuid, []).append(local_rank)
        return {uuid: ranks for uuid, ranks in users.items() if len(ranks) > 1}

    def verdict(self) -> str:
        """'' when every local rank has a GPU of its own; else e.g. 'on node n1, local ranks 0, 1 use the same GPU
        (GPU-6f1c2a3b) (CUDA_VISIBLE_DEVICES=0 there)'."""
        if not self.shared:
            return ""
        parts = [f"local ranks {', '.join(map(str, ranks))} use the same GPU ({uuid[:12]})"
                 for uuid, ranks in self.shared.items()]
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        where = f" (CUDA_VISIBLE_DEVICES={visible} there)" if visible is not None else ""
        return f"on node {self.host}, " + "; ".join(parts) + where


def shared_gpus(store, launch: LaunchInfo, device: torch.device, timeout_s: float) -> list[str]:
    """Collective over every rank of a multi-process job: one line per node whose ranks share a GPU (empty when every
    rank has its own, and on CPUs, where nothing is exchanged). The same list on every rank, so every rank chooses
    the same backend."""
    if device.type != "cuda":
        return []
    return exchange(store, launch, device_uuid(device), timeout_s)[1]
