"""The runtime value: created once per process from the launch info, passed down, never global."""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import logging
from dataclasses import dataclass
from typing import Iterator

import torch
import torch.distributed as dist

from hpctrain.config.schema import DistSection
from hpctrain.dist.env import LaunchInfo, detect_launch
from hpctrain.errors import UserError, raised_on_every_rank

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Runtime(LaunchInfo):
    """The launch facts plus what this process bound: its device and its process-group backend."""

    device: torch.device
    """The device this rank computes on (cuda:local_rank, or cpu)."""
    backend: str
    """Process-group backend ('nccl', 'gloo'), or '' for one process."""

    @property
    def is_main(self) -> bool:
        """Global rank 0: the only rank that prints and writes shared files."""
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1


def choose_backend(requested: str, cuda: bool) -> str:
    if requested == "auto":
        return "nccl" if cuda else "gloo"
    if requested == "nccl" and not cuda:
        raise UserError(
            "dist.backend='nccl' needs CUDA GPUs, and this process sees none",
            "use dist.backend=auto (gloo on CPU), or run on a GPU node.",
        )
    return requested


def choose_device(launch: LaunchInfo) -> torch.device:
    if not torch.cuda.is_available():
        return torch.device("cpu")
    count = torch.cuda.device_count()
    if launch.local_rank >= count:
        raise UserError(
            f"local rank {launch.local_rank} on {launch.hostname} has no GPU: only {count} visible",
            "start at most one process per GPU (--nproc-per-node, slurm.gpus_per_node).",
        )
    return torch.device("cuda", launch.local_rank)


def init_runtime(launch: LaunchInfo, cfg: DistSection) -> Runtime:
    """Bind the device and join the process group (when there is more than one process)."""
    device = choose_device(launch)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    backend = choose_backend(cfg.backend, device.type == "cuda") if launch.world_size > 1 else ""
    if backend:
        init_method = "env://" if launch.launcher == "torchrun" else f"tcp://{launch.master_addr}:{launch.master_port}"
        dist.init_process_group(
            backend=backend,
            init_method=init_method,
            rank=launch.rank,
            world_size=launch.world_size,
            timeout=datetime.timedelta(seconds=cfg.timeout_s),
            # Binding the device makes NCCL create its communicator eagerly and on the right GPU.
            device_id=device if backend == "nccl" else None,
        )
    return Runtime(**dataclasses.asdict(launch), device=device, backend=backend)


def single_process_runtime(device: torch.device | None = None) -> Runtime:
    """One process, no process group, whatever the environment says: for tools that measure or load on
    this machine alone (plan, benchmarks, tests). The device defaults to the one a rank 0 would bind."""
    launch = detect_launch({})
    return Runtime(**dataclasses.asdict(launch), device=device or choose_device(launch), backend="")


def shutdown(runtime: Runtime, meet: bool) -> None:
    """Leave the process group. When every rank is known to be here (success, or an error all ranks
    raised together) they meet first: a rank that destroys its group while a peer is still finishing
    the last collective (e.g. rank 0's side of a broadcast) can hang or abort in gloo's teardown
    ("terminate called without an active exception", seen once in CI after a failed save)."""
    if not (runtime.backend and dist.is_initialized()):
        return
    if meet:
        dist.barrier()
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
