"""The runtime value: created once per process from the launch info, passed down, never global."""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import logging
import os
from dataclasses import dataclass
from typing import Iterator, Sequence

import torch
import torch.distributed as dist

from hpctrain import compat
from hpctrain.config.schema import DistSection
from hpctrain.dist.env import LaunchInfo, detect_launch, gloo_ifname_from_nccl
from hpctrain.dist.gpu_identity import shared_gpus
from hpctrain.errors import UserError, raised_on_every_rank

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Runtime(LaunchInfo):
    """The launch facts plus what this process bound: its device and its process-group backend."""

    device: torch.device
    """The device this rank computes on (cuda:local_rank, or cpu)."""
    backend: str
    """Process-group backend ('nccl', 'gloo'), or '' for one process."""
    control: dist.ProcessGroup | None = None
    """The control plane: a gloo group with dist.control_timeout_s for barriers and object collectives (CPU
    tensors: no device synchronisation). None for one process."""

    @property
    def is_main(self) -> bool:
        """Global rank 0: the only rank that prints and writes shared files."""
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1


def choose_backend(requested: str, cuda: bool, shared: Sequence[str] = ()) -> str:
    """shared: what the ranks found about GPUs used by several of a node's processes (gpu_identity.shared_gpus), where
    NCCL cannot go (it refuses two ranks of a communicator on one device, "Duplicate GPU detected"): auto takes gloo
    there, which moves CUDA tensors through host memory (slow, but right for trying multi-process code on a one-GPU
    machine)."""
    if requested == "auto":
        return "nccl" if cuda and not shared else "gloo"
    if requested == "nccl" and not cuda:
        raise UserError(
            "dist.backend='nccl' needs CUDA GPUs, and this process sees none",
            "use dist.backend=auto (gloo on CPU), or run on a GPU node.",
        )
    if requested == "nccl" and shared:
        raise UserError(
            f"dist.backend='nccl', but {'; '.join(shared)}: NCCL refuses two ranks on one device",
            "give each process its own GPU (one process per GPU: --nproc-per-node, or srun --gpus-per-task=1 / "
            "--gpu-bind=single:1 / slurm.gpu_bind=per_task), or use dist.backend=auto (gloo) to run several "
            "processes on one GPU.",
        )
    return requested


def choose_device(launch: LaunchInfo) -> torch.device:
    """cuda:LOCAL_RANK when the process sees every GPU of its node, cuda:0 when it sees exactly one (srun
    --gpus-per-task=1, --gpu-bind=single:1, or a site that sets CUDA_VISIBLE_DEVICES per task)."""
    if not torch.cuda.is_available():
        return torch.device("cpu")
    count = torch.cuda.device_count()
    if count == 1:
        return torch.device("cuda", 0)
    if count >= launch.local_world_size and launch.local_rank < count:
        return torch.device("cuda", launch.local_rank)
    raise UserError(
        f"local rank {launch.local_rank} of {launch.local_world_size} on {launch.hostname} sees {count} GPUs: "
        "each process must see either one GPU (its own) or all of the node's",
        "start at most one process per GPU (--nproc-per-node, slurm.gpus_per_node), and bind either one GPU per "
        "task (slurm.launcher=srun with slurm.gpu_bind=per_task) or none (every GPU visible to every process).",
    )


def init_runtime(launch: LaunchInfo, cfg: DistSection) -> Runtime:
    """Bind the device and join the process group (when there is more than one process)."""
    device = choose_device(launch)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    backend = ""
    if launch.world_size > 1:
        ifname = gloo_ifname_from_nccl()
        if ifname:  # read by gloo when a group is made: the control group, and the training one on CPU nodes
            os.environ["GLOO_SOCKET_IFNAME"] = ifname
        # The rendezvous init_process_group would make itself, made first: the ranks compare their GPUs through its
        # store before the backend is chosen (gpu_identity.py).
        init_method = "env://" if launch.launcher == "torchrun" else f"tcp://{launch.master_addr}:{launch.master_port}"
        timeout = datetime.timedelta(seconds=cfg.timeout_s)
        store, _, _ = next(dist.rendezvous(init_method, rank=launch.rank, world_size=launch.world_size,
                                           timeout=timeout))
        store.set_timeout(timeout)
        shared = shared_gpus(store, launch, device, cfg.timeout_s)
        backend = choose_backend(cfg.backend, device.type == "cuda", shared)
        if backend == "gloo" and shared and launch.rank == 0:
            log.warning("%s: gloo instead of NCCL, which refuses two ranks on one GPU (all-reduce through host memory, "
                        "slow). For NCCL give each process its own GPU (srun --gpus-per-task=1 or --gpu-bind=single:1, "
                        "or one process per GPU)", "; ".join(shared))
        dist.init_process_group(
            backend=backend_spec(backend, cfg),
            store=dist.PrefixStore("default_pg", store),  # as init_process_group keys its own store
            rank=launch.rank,
            world_size=launch.world_size,
            timeout=timeout,
            # Binding the device makes NCCL create its communicator eagerly and on the right GPU.
            device_id=device if backend == "nccl" else None,
        )
    control = _control_group(cfg) if backend else None
    return Runtime(**dataclasses.asdict(launch), device=device, backend=backend, control=control)


def backend_spec(backend: str, cfg: DistSection) -> str:
    """The training group's backend string. FSDP2's CPU offload keeps the sharded gradients on the host, so the
    global norm of gradient clipping is an all-reduce of CPU tensors, which NCCL refuses: that group then also has
    gloo for CPU tensors ("cpu:gloo,cuda:nccl", as torchtitan sets up for offload); CUDA tensors still go to NCCL."""
    if backend == "nccl" and cfg.strategy == "fsdp" and cfg.fsdp_cpu_offload:
        return "cpu:gloo,cuda:nccl"
    return backend


def _control_group(cfg: DistSection) -> dist.ProcessGroup:
    """A gloo group over all ranks with the control plane's longer timeout. Separate even when training runs on
    gloo: the timeouts differ, and a wait for rank 0's file system must not count against the training one.
    (Lightning and Accelerate also keep object collectives off NCCL; here the stop vote goes too.)"""
    # Connecting (gloo's full mesh) gets the training timeout where torch allows: a node whose hostname resolves to
    # an address the others cannot reach (set GLOO_SOCKET_IFNAME) fails at start-up, not an hour later.
    return compat.gloo_group(connect_timeout_s=cfg.timeout_s, timeout_s=cfg.control_timeout_s)


def single_process_runtime(device: torch.device | None = None) -> Runtime:
    """One process, no process group, whatever the environment says: for tools that measure or load on
    this machine alone (plan, benchmarks, tests). The device defaults to the one a rank 0 would bind."""
    launch = detect_launch({})
    return Runtime(**dataclasses.asdict(launch), device=device or choose_device(launch), backend="")


def shutdown(runtime: Runtime, meet: bool) -> None:
    """Leave the process group when every rank is known to be here (success, or an error all ranks raised
    together): they meet first, since a rank that destroys its group while a peer is still finishing the last
    collective (e.g. rank 0's side of a broadcast) can hang or abort in gloo's teardown.

    A rank that failed alone leaves the group as it is: its peers are inside a collective it will never join,
    and destroying the group would close their connections before this rank has reported its error and exited.
    A peer then fails first on "Connection closed by peer", and its launcher can SIGTERM this rank in the middle
    of its own report (seen in CI: exit 143 instead of the error's 2). The process's exit closes the group."""
    if not (runtime.backend and dist.is_initialized()) or not meet:
        return
    dist.barrier(group=runtime.control)
    dist.destroy_process_group()


@contextlib.contextmanager
def distributed_session(launch: LaunchInfo, cfg: DistSection) -> Iterator[Runtime]:
    runtime = init_runtime(launch, cfg)
    meet = False
    try:
        yield runtime
        meet = True
    except BaseException as err:
        meet = raised_on_every_rank(err)
        raise
    finally:
        shutdown(runtime, meet)
