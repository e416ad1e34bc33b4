"""DataLoader construction: keyed datasets for per-sample augmentation, and settings from the machine."""

from __future__ import annotations

import signal
from typing import Any, Callable

import torch
from torch.utils.data import DataLoader, Dataset, Sampler

from hpctrain.config.schema import DataSection
from hpctrain.data.sampler import SampleKey
from hpctrain.data.seeding import sample_generator
from hpctrain.dist.env import cpus_available
from hpctrain.dist.runtime import Runtime

Transform = Callable[[Any, torch.Generator], Any]


class KeyedDataset(Dataset):
    """Wraps a map-style dataset: takes a SampleKey, applies ``transform(sample, generator)``
    with a generator seeded from (seed, epoch, index)."""

    def __init__(self, base: Dataset, transform: Transform | None, seed: int) -> None:
        self.base = base
        self.transform = transform
        self.seed = seed

    def __len__(self) -> int:
        return len(self.base)  # type: ignore[arg-type]

    def __getitem__(self, key: SampleKey) -> Any:
        sample = self.base[key.index]
        if self.transform is None:
            return sample
        return self.transform(sample, sample_generator(self.seed, key.epoch, key.index))


STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2, signal.SIGHUP)


def ignore_stop_signals(_worker_id: int) -> None:
    """worker_init_fn: stop signals are the rank's to act on, not its loader workers'.

    Slurm signals every process of a job step (scancel --signal, the time limit's
    SIGTERM). torch's loader workers die of SIGUSR1/2 and of a SIGTERM that is not
    from their parent, and their rank then crashes ("DataLoader worker exited
    unexpectedly") instead of saving a checkpoint. Workers still end with their rank:
    they watch their parent, and Slurm's final SIGKILL cannot be ignored."""
    for sig in STOP_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)


def auto_workers(runtime: Runtime) -> int:
    """Worker processes per rank from the CPUs this process may use, shared by the ranks of the
    node, one CPU left for the rank's own process; at most 8 (more rarely helps and costs memory)."""
    per_rank = cpus_available() // max(1, runtime.local_world_size)
    return max(0, min(8, per_rank - 1))


def loader_kwargs(cfg: DataSection, runtime: Runtime) -> dict[str, Any]:
    workers = auto_workers(runtime) if cfg.num_workers < 0 else cfg.num_workers
    kwargs: dict[str, Any] = {
        "num_workers": workers,
        "pin_memory": cfg.pin_memory and runtime.device.type == "cuda",
    }
    if workers > 0:
        kwargs["persistent_workers"] = cfg.persistent_workers
        kwargs["prefetch_factor"] = cfg.prefetch_factor
        kwargs["worker_init_fn"] = ignore_stop_signals
        kwargs["multiprocessing_context"] = cfg.worker_start
    return kwargs


def build_loader(
    dataset: Dataset, batch_sampler: Sampler, cfg: DataSection, runtime: Runtime, collate_fn: Callable | None = None
) -> DataLoader:
    return DataLoader(dataset, batch_sampler=batch_sampler, collate_fn=collate_fn, **loader_kwargs(cfg, runtime))
