"""DataLoader construction: keyed datasets for per-sample augmentation, skipping of unreadable
samples, and loader settings from the machine."""

from __future__ import annotations

import contextlib
import errno
import functools
import multiprocessing
import os
import pickle
import random
import select
import signal
import threading
import time
from multiprocessing import resource_tracker
from multiprocessing.context import get_spawning_popen
from typing import Any, Callable, Iterator, NamedTuple

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, Sampler, default_collate, get_worker_info

from hpctrain.config.schema import DataSection
from hpctrain.data.sampler import SampleKey
from hpctrain.data.seeding import SALT_WORKER, mix_seed, sample_generator
from hpctrain.data.shardset import DataError
from hpctrain.data.tensor_pack import pack, unpack
from hpctrain.dist.env import cpus_available
from hpctrain.dist.runtime import Runtime
from hpctrain.errors import UserError

Transform = Callable[[Any, torch.Generator], Any]


class KeyedDataset(Dataset):
    """Wraps a map-style dataset. Takes a SampleKey (training: ``transform(sample, generator)`` with a
    generator seeded from (seed, epoch, index)) or a plain index (validation: no transform).

    In a loader worker, the global RNGs (torch, numpy, random) are seeded per (seed, epoch, rank,
    worker) when an epoch starts, for any randomness a user's code draws beyond the per-sample
    generator. With ``on_error='skip'``, samples that raise DataError are left out of their batch and
    reported with it (see :class:`SkipCountingLoader`)."""

    def __init__(self, base: Dataset, transform: Transform | None, seed: int, rank: int = 0, on_error: str = "raise") -> None:
        self.base = base
        self.transform = transform
        self.seed = seed
        self.rank = rank
        self.on_error = on_error
        self._seeded_epoch = -1

    def __len__(self) -> int:
        return len(self.base)  # type: ignore[arg-type]

    def __getitem__(self, key: SampleKey | int) -> Any:
        if not isinstance(key, SampleKey):
            return self.base[key]
        self._seed_worker(key.epoch)
        sample = self.base[key.index]
        if self.transform is None:
            return sample
        return self.transform(sample, sample_generator(self.seed, key.epoch, key.index))

    def __getitems__(self, keys: list[SampleKey | int]) -> list[Any]:
        """The DataLoader fetches a whole batch through this when it exists."""
        out = Fetched()
        for key in keys:
            try:
                out.append(self[key])
            except DataError as err:
                if self.on_error != "skip":
                    raise
                out.skipped.append(str(err).splitlines()[0])
        return out

    def __reduce_ex__(self, protocol: Any) -> Any:
        """A worker's start pickles its data set: many tensors go as one shared block (data/tensor_pack.py), packed
        anew at every start (the data set as it is now; what torch sends as descriptors is valid for one start)."""
        if get_spawning_popen() is None:  # not a process start (fork sends nothing; a plain pickle copies)
            return super().__reduce_ex__(protocol)
        return _unpacked, pack(self.__dict__)

    def _seed_worker(self, epoch: int) -> None:
        info = get_worker_info()
        if info is None or epoch == self._seeded_epoch:
            return
        self._seeded_epoch = epoch
        seed = mix_seed(SALT_WORKER, self.seed, epoch, self.rank, info.id)
        torch.manual_seed(seed)
        random.seed(seed)
        np.random.seed(seed % 2**32)


def _unpacked(*packed: Any) -> KeyedDataset:
    keyed = KeyedDataset.__new__(KeyedDataset)
    keyed.__dict__.update(unpack(*packed))
    return keyed


class Fetched(list):
    """The samples of one batch, and the messages of those skipped."""

    def __init__(self) -> None:
        super().__init__()
        self.skipped: list[str] = []


class Counted(NamedTuple):
    batch: Any
    skipped: list[str]


class SkipAwareCollate:
    """Runs in the worker: collates what was readable and passes the skip messages along with it."""

    def __init__(self, collate: Callable[[list[Any]], Any] | None) -> None:
        self.collate = collate or default_collate

    def __call__(self, samples: list[Any]) -> Counted:
        skipped = list(getattr(samples, "skipped", []))
        if not samples:
            raise DataError(f"every sample of a batch was unreadable, e.g. {skipped[0] if skipped else '?'}",
                            "too much of the data set is corrupt to skip: re-create the shards.")
        return Counted(self.collate(list(samples)), skipped)


class SkipCountingLoader:
    """Iterates a DataLoader, unwraps the batches, and keeps the skip messages until taken. Without workers or
    pinning it fetches the DataLoader's batches itself (fetch_in_process), which costs less per batch.

    Also turns a DataError raised in a worker (which torch re-raises with the worker's traceback as
    its message) back into the clean message and hint the user should see."""

    def __init__(self, loader: DataLoader, counting: bool) -> None:
        self.loader = loader
        self.counting = counting
        self.skipped: list[str] = []

    def __len__(self) -> int:
        return len(self.loader)

    @property
    def batch_sampler(self) -> Any:
        return self.loader.batch_sampler

    @property
    def dataset(self) -> Dataset:
        return self.loader.dataset

    def __iter__(self) -> Iterator[Any]:
        for item in self._batches():
            if self.counting:
                item, skipped = item
                self.skipped.extend(skipped)
            yield item

    def _batches(self) -> Iterator[Any]:
        loader = self.loader
        if loader.num_workers == 0 and not loader.pin_memory:
            yield from fetch_in_process(loader)
            return
        with stop_signals_blocked() if loader.num_workers > 0 else contextlib.nullcontext():  # workers start in iter()
            it = start_workers(loader)
        while True:
            try:
                item = next(it)
            except StopIteration:
                return
            except DataError as err:
                raise _clean_worker_error(err) from None
            yield item

    def take_skipped(self) -> list[str]:
        out, self.skipped = self.skipped, []
        return out


def start_workers(loader: DataLoader) -> Iterator[Any]:
    """iter(loader), which starts its workers and sends each the data set; a data set that cannot be sent stops the
    run with what to do."""
    start = loader.multiprocessing_context.get_start_method() if loader.multiprocessing_context else "?"
    cannot = f"the data set cannot be sent to the loader's worker processes (data.worker_start={start} pickles it)"
    try:
        return iter(loader)
    except (AttributeError, TypeError, pickle.PicklingError) as err:
        if "pickle" not in str(err):
            raise
        raise UserError(f"{cannot}: {err}",
                        "define transforms and datasets at module level (a lambda or a function inside a method cannot "
                        "be pickled), or set data.num_workers=0 (no worker processes).") from None
    except (ValueError, OSError) as err:
        if str(err) != "too many fds" and getattr(err, "errno", None) != errno.EMFILE:
            raise
        raise UserError(f"{cannot}: its tensors need more file descriptors than a process start can pass ({err})",
                        "hold the samples as plain tensors that need no gradient (those are sent as one shared block), "
                        "or set data.num_workers=0 (no worker processes).") from None


def fetch_in_process(loader: DataLoader) -> Iterator[Any]:
    """The batches DataLoader yields without workers or pinning (from the same batch sampler, the same fetch
    through KeyedDataset.__getitems__, the same collate function), without its per-batch bookkeeping (a
    profiler range, counters, checks for iterable datasets): about 8 us a batch less here, a good part of
    hpctrain's own per-step cost."""
    # DataLoader draws a base seed for its workers from the global torch RNG at every iter(), workers or
    # not: drawn here too, the model's random stream (dropout, diffusion noise) stays exactly what it was.
    torch.empty((), dtype=torch.int64).random_(generator=loader.generator)
    dataset, collate = loader.dataset, loader.collate_fn
    for indices in loader.batch_sampler:
        yield collate(dataset.__getitems__(indices))


def _clean_worker_error(err: DataError) -> DataError:
    text = str(err)
    marker = "DataError: "
    if "Original Traceback" not in text or marker not in text:
        return err
    message = text.rsplit(marker, 1)[1].strip()
    body, _, hint = message.partition("\nHINT: ")
    return DataError(body.strip(), hint.strip() or err.hint)


# SIGINT too: a terminal's Ctrl-C reaches the whole foreground process group, loader workers included, and torch's
# worker loop exits quietly on KeyboardInterrupt, so the rank's next batch failed ("DataLoader worker exited
# unexpectedly") instead of its checkpoint being saved.
STOP_SIGNALS = (signal.SIGUSR1, signal.SIGUSR2, signal.SIGHUP, signal.SIGINT)


@contextlib.contextmanager
def stop_signals_blocked() -> Iterator[None]:
    """Block the stop signals in this thread while loader processes start, so that they start blocked.

    Slurm signals every process of a step, and a loader process dies of SIGUSR1/2/HUP/TERM by default.
    A blocked mask is inherited through fork and survives exec, so it covers what no worker_init_fn
    can: the forkserver helper (started on the first iter(), parent of every worker, and the workers die
    with it), and each worker's first moments before worker_init_fn runs. Blocking, not ignoring: a
    signal for this rank that arrives meanwhile is delivered to another thread or when the block ends,
    not lost. The helper stays blocked for life; workers take over in guard_stop_signals.
    multiprocessing's resource tracker (one per rank) is started here too, so it inherits the block."""
    stop = {*STOP_SIGNALS, signal.SIGTERM}
    old = signal.pthread_sigmask(signal.SIG_BLOCK, stop)
    try:
        # Starting the tracker (or restarting it after a death) ends with CPython unblocking SIGINT and SIGTERM
        # in this thread, whatever the mask was before: start it now, then block again for the workers.
        resource_tracker.ensure_running()
        signal.pthread_sigmask(signal.SIG_BLOCK, stop)
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


def guard_stop_signals(_worker_id: int, rank_pid: int) -> None:
    """worker_init_fn: stop signals are the rank's to act on, not its loader workers'.

    Slurm signals every process of a job step (scancel --signal, the time limit's SIGTERM).
    torch's loader workers die of SIGUSR1/2 and of a SIGTERM that is not from their parent
    (with forkserver, their parent is the server, not the rank), and the rank then crashes
    ("DataLoader worker exited unexpectedly") instead of saving a checkpoint. So USR1/USR2/HUP
    are ignored, and SIGTERM is taken by a thread that reads the sender: from the rank (torch's
    and multiprocessing's shutdown terminate workers that way) the worker exits; from anyone
    else it is ignored. Ignoring every SIGTERM, as this did before, made a process hang at exit
    when an error left a loader alive: multiprocessing's exit handler SIGTERMs daemon children
    and joins them. Workers still end with their rank: they watch it, and SIGKILL stays."""
    for sig in STOP_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})  # threads started below inherit the mask
    threading.Thread(target=_sigterm_from, args=(rank_pid,), name="hpctrain-sigterm", daemon=True).start()
    threading.Thread(target=_exit_with, args=(rank_pid,), name="hpctrain-rank-watch", daemon=True).start()


def _exit_with(rank_pid: int) -> None:
    """End this worker when its rank is gone. torch's own watchdog compares the worker's parent with the one it
    started under, which with forkserver is the server, not the rank: a rank killed mid-run (torchrun's SIGTERM
    after a peer failed) left its workers, and through them the server (each worker holds the server's keep-alive
    pipe), running for good, holding the job's stdout open (seen in CI as a finished run that never hit EOF)."""
    try:
        fd = os.pidfd_open(rank_pid)  # readable once the process has exited; immune to pid reuse
    except (AttributeError, OSError):
        while True:  # no pidfd (old kernel): poll
            time.sleep(1.0)
            try:
                os.kill(rank_pid, 0)
            except ProcessLookupError:
                os._exit(1)
            except PermissionError:
                pass
    select.select([fd], [], [])
    os._exit(1)


def _sigterm_from(rank_pid: int) -> None:
    while True:
        info = signal.sigwaitinfo({signal.SIGTERM})
        if info.si_pid in (rank_pid, os.getppid()):
            os._exit(128 + signal.SIGTERM)


def in_memory(dataset: Any) -> bool:
    """Samples that are indexed, not read or decoded: a TensorDataset, a list or tuple of samples that hold tensors
    or arrays (the usual form of variable-length data), a Subset or concatenation of those, or a data set that says
    so with `in_memory = True`. Worker processes only add pickling and a pipe per batch there (measured: a 4-class
    CNN on a TensorDataset, 2.0 s an epoch without workers, 6.8 s with them)."""
    from torch.utils.data import ConcatDataset, Subset, TensorDataset

    if isinstance(dataset, TensorDataset) or getattr(dataset, "in_memory", False) is True:
        return True
    if isinstance(dataset, (list, tuple)):  # the first sample tells: a list of file names is read, not indexed
        return len(dataset) > 0 and _holds_tensor(dataset[0])
    if isinstance(dataset, Subset):
        return in_memory(dataset.dataset)
    if isinstance(dataset, ConcatDataset):
        return all(in_memory(d) for d in dataset.datasets)
    return False


def _holds_tensor(sample: Any) -> bool:
    if isinstance(sample, (tuple, list)):
        return any(_holds_tensor(part) for part in sample)
    if isinstance(sample, dict):
        return any(_holds_tensor(part) for part in sample.values())
    return isinstance(sample, (torch.Tensor, np.ndarray))


def auto_workers(runtime: Runtime, dataset: Any = None, transform: Any = None) -> int:
    """Worker processes per rank: none for an in-memory data set without a per-sample transform, or with one when
    training on the CPU (workers would take the cores the model computes on); else from the CPUs this process may
    use, shared by the ranks of the node, one CPU left for the rank's own process; at most 8 (more rarely helps and
    costs memory). An in-memory set with augmentation on a GPU (DDPM's flips of CIFAR-10) keeps its workers: there
    the transform is the host's work that overlaps the GPU's."""
    if dataset is not None and in_memory(dataset) and (transform is None or runtime.device.type == "cpu"):
        return 0
    per_rank = cpus_available() // max(1, runtime.local_world_size)
    return max(0, min(8, per_rank - 1))


def loader_kwargs(cfg: DataSection, runtime: Runtime, dataset: Any = None, transform: Any = None) -> dict[str, Any]:
    workers = auto_workers(runtime, dataset, transform) if cfg.num_workers < 0 else cfg.num_workers
    kwargs: dict[str, Any] = {
        "num_workers": workers,
        "pin_memory": cfg.pin_memory and runtime.device.type == "cuda",
    }
    if workers > 0:
        kwargs["persistent_workers"] = cfg.persistent_workers
        kwargs["prefetch_factor"] = cfg.prefetch_factor
        kwargs["worker_init_fn"] = functools.partial(guard_stop_signals, rank_pid=os.getpid())
        kwargs["multiprocessing_context"] = worker_context(cfg.worker_start)
    return kwargs


def worker_context(start: str) -> multiprocessing.context.BaseContext:
    """The loader workers' start method. forkserver's helper imports torch and hpctrain's loader once, so every
    worker forked from it starts with them loaded: by default each worker imported torch again (about 2 s of CPU
    per worker on this project's VMs, at every start of a run). Not the data set's own module: a user's module may
    start threads, touch CUDA or draw entropy when imported, which a helper that forks must not (each worker still
    imports it when it unpickles the data set, as before)."""
    ctx = multiprocessing.get_context(start)
    if start == "forkserver":
        ctx.set_forkserver_preload(["torch", __name__])
    return ctx


def build_loader(
    dataset: Dataset, batch_sampler: Sampler, cfg: DataSection, runtime: Runtime, collate_fn: Callable | None = None,
    seed: int = 0, transform: Transform | None = None,
) -> SkipCountingLoader:
    """A loader over ``KeyedDataset(dataset)``; with data.on_error=skip, unreadable samples are counted, not fatal."""
    keyed = KeyedDataset(dataset, transform, seed, runtime.rank, cfg.on_error)
    counting = cfg.on_error == "skip"
    collate = SkipAwareCollate(collate_fn) if counting else collate_fn
    loader = DataLoader(keyed, batch_sampler=batch_sampler, collate_fn=collate,
                        **loader_kwargs(cfg, runtime, dataset, transform if cfg.augment else None))
    return SkipCountingLoader(loader, counting)
