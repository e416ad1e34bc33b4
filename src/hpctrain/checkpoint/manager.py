"""Saving and restoring a whole training run across ranks.

Under DDP every rank holds the same model and optimizer state, so rank 0 writes
them; each rank's RNG state is gathered to rank 0 and written with them. The
outcome of rank 0's write is broadcast, so a failed save (full disk, I/O error)
raises on every rank instead of leaving the others waiting at a barrier. With
ckpt.async_save, rank 0 writes from a CPU snapshot in a background thread and
the outcome is broadcast at the next save (or when the loop ends). Both kinds of
save write CPU tensors (a GPU run's files load anywhere, and are the same bytes).

A resume reads the checkpoint once: rank 0 reads each file and sends its bytes to
the other ranks over the data plane, and scatters each rank its own RNG entry.
"""

from __future__ import annotations

import json
import logging
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

from torch import nn

from hpctrain.checkpoint import policy, storage
from hpctrain.checkpoint.background import BackgroundWriter
from hpctrain.checkpoint.snapshot import CpuStaging
from hpctrain.checkpoint.storage import Checked
from hpctrain.dist.collectives import barrier, broadcast_bytes, broadcast_object, gather_to_main, scatter_objects
from hpctrain.dist.runtime import Runtime
from hpctrain.errors import UserError, on_every_rank
from hpctrain.train.rng import capture_rng, restore_rng, seed_rank_streams
from hpctrain.train.state import TrainState

log = logging.getLogger(__name__)


def select_checkpoint(
    root: Path, resume: str, experiment: str, verify_checksums: bool = True
) -> tuple[Checked | None, list[Checked]]:
    """Which checkpoint a run starts from, per ckpt.resume; None for a fresh start.

    Raises UserError (and deletes nothing) when the choice is impossible."""
    if resume == "never":
        existing = storage.list_checkpoints(root)
        if existing:
            raise UserError(
                f"ckpt.resume=never, but '{root}' already holds checkpoints ({existing[0].name} ...)",
                "use a new run.dir, or ckpt.resume=auto to continue that run.",
            )
        return None, []
    if resume == "auto":
        chosen, skipped = storage.find_latest_valid(root, verify_checksums)
        if chosen is None and skipped:
            reasons = "; ".join(f"{c.path.name}: {c.problem}" for c in skipped)
            raise UserError(
                f"'{root}' holds checkpoints, but none is valid ({reasons}); nothing was deleted",
                "point ckpt.resume at a good checkpoint directory, or move the run dir away and start anew.",
            )
    else:
        chosen, skipped = storage.check_checkpoint(Path(resume), verify_checksums), []
        if not chosen.valid:
            raise UserError(f"checkpoint '{resume}' is not usable: {chosen.problem}", "give another checkpoint directory.")
    if chosen is not None:
        saved_for = chosen.manifest.get("experiment") if chosen.manifest else None
        if saved_for != experiment:
            raise UserError(
                f"checkpoint '{chosen.path}' was written by experiment '{saved_for}', not '{experiment}'",
                f"use another run.dir for '{experiment}' (run.dir=...), or train '{saved_for}' to continue that run.",
            )
    return chosen, skipped


def read_state(path: Path) -> TrainState | None:
    """A checkpoint's train state, or None when unreadable (the workers' checksum verification reports it)."""
    try:
        return TrainState.from_dict(json.loads((path / "state.json").read_text()))
    except (OSError, ValueError, KeyError, TypeError):
        return None


@dataclass(frozen=True)
class Resumed:
    path: Path
    state: TrainState
    saved_world_size: int


@dataclass(frozen=True)
class SaveOutcome:
    """What became of one save (rank 0 knows; it is broadcast so every rank acts on it)."""

    step: int
    error: str = ""
    """'' when the checkpoint is complete on disk (or, for a background save, when its copy is taken)."""
    is_io: bool = False
    """The failure was an OSError (full disk, quota, permissions): the user's to fix."""


class Checkpointer:
    def __init__(
        self, run_dir: Path, experiment: str, runtime: Runtime, config_text: str, keep_last: int,
        async_save: bool = False,
    ) -> None:
        self.root = run_dir / "checkpoints"
        self.experiment = experiment
        self.runtime = runtime
        self.config_text = config_text
        self.keep_last = keep_last
        self.async_save = async_save
        self._writer: BackgroundWriter[SaveOutcome] = BackgroundWriter()
        self._staging = CpuStaging()

    def save(self, state: TrainState, stateful: Mapping[str, Any], wait: bool = False) -> None:
        """Collective: every rank calls it at the same step. With async_save (and not ``wait``) rank 0
        copies the state to CPU memory and writes it in the background: training pauses only for the
        copy. A save first waits for the previous background write, and a failure of that write
        raises here, on every rank."""
        self.settle()
        rng = gather_to_main(capture_rng(self.runtime.device), self.runtime)  # None on the other ranks
        outcome = self._save_on_main(state, stateful, rng, background=self.async_save and not wait) if self.runtime.is_main else None
        _raise_if_failed(broadcast_object(outcome, self.runtime), self.root)

    def settle(self) -> None:
        """Collective: wait for a background write still running; its failure raises on every rank.
        The training loop calls it before it leaves, so a finished run's checkpoint is on disk."""
        if not self.async_save:
            return
        outcome = self._writer.wait() if self.runtime.is_main else None
        _raise_if_failed(broadcast_object(outcome, self.runtime), self.root)

    def _save_on_main(self, state: TrainState, stateful: Mapping[str, Any], rng: list[Any], background: bool) -> SaveOutcome:
        started = time.perf_counter()
        try:
            files = self._files(state, stateful, rng)
            if not background:
                # CPU tensors, as the background save writes: the live state's CUDA tensors would be written
                # tagged with their device (other bytes than an async save's, and a load that needs a
                # map_location). Only device tensors are copied: on a CPU-only run this copies nothing.
                files = self._staging.snapshot(files, copy_cpu_tensors=False)
                return self._write(state.step, files, self._meta(state), started, paused_s=None)
            # The copy is the whole pause: after it, training may change every live tensor.
            files = self._staging.snapshot(files)
        except Exception as err:  # any failure must reach the other ranks, not leave them waiting
            return _failed(state.step, err)
        paused = time.perf_counter() - started
        # Bound now: the loop advances `state` while the thread runs.
        step, meta = state.step, self._meta(state)
        self._writer.submit(lambda: self._write(step, files, meta, time.perf_counter(), paused_s=paused))
        return SaveOutcome(step)

    def _write(self, step: int, files: dict[str, Any], meta: dict[str, Any], started: float, paused_s: float | None) -> SaveOutcome:
        try:
            path = storage.write_checkpoint(self.root, step, files, meta)
            seconds = time.perf_counter() - started
            self._retire_old(path)
            size = sum(f.stat().st_size for f in path.iterdir())
        except Exception as err:
            return _failed(step, err)
        if paused_s is None:
            log.info("saved checkpoint %s (%.1f MB in %.0f ms)", path, size / 1e6, seconds * 1000)
        else:
            log.info("saved checkpoint %s (%.1f MB; training paused %.0f ms for the copy, written in the background "
                     "in %.0f ms)", path, size / 1e6, paused_s * 1000, seconds * 1000)
        return SaveOutcome(step)

    def _files(self, state: TrainState, stateful: Mapping[str, Any], rng: list[Any]) -> dict[str, Any]:
        files: dict[str, Any] = {
            "model.pt": stateful["model"].state_dict(),
            "optim.pt": {k: stateful[k].state_dict() for k in ("optimizer", "scheduler", "scaler")},
            "rng.pt": rng,
            "state.json": json.dumps(state.to_dict() | {"world_size": self.runtime.world_size}, indent=1),
            "config.toml": self.config_text,
        }
        if stateful.get("ema") is not None:
            files["ema.pt"] = stateful["ema"].state_dict()
        if stateful.get("experiment") is not None:
            files["experiment.pt"] = stateful["experiment"].state_dict()
        return files

    def _meta(self, state: TrainState) -> dict[str, Any]:
        return {"experiment": self.experiment, "epoch": state.epoch, "world_size": self.runtime.world_size}

    def _retire_old(self, newest: Path) -> None:
        storage.remove_stale_temporaries(self.root)
        valid = {
            int(p.name[len(storage.PREFIX):]): p
            for p in storage.list_checkpoints(self.root)
            if storage.check_checkpoint(p, verify_checksums=False).valid
        }
        protected = int(newest.name[len(storage.PREFIX):])
        for step in policy.steps_to_delete(sorted(valid), self.keep_last, protected):
            shutil.rmtree(valid[step], ignore_errors=True)

    def restore(self, resume: str, stateful: Mapping[str, Any], seed: int) -> Resumed | None:
        """Collective: rank 0 picks and verifies the checkpoint, every rank loads it (from rank 0's one read)."""
        chosen = self._choose(resume)
        return self._load(chosen, stateful, seed) if chosen else None

    def restore_weights(self, resume: str, model: nn.Module) -> Resumed:
        """Collective: load only the weights to use (the EMA ones when the checkpoint has them)."""
        chosen = self._choose(resume)
        if chosen is None:
            raise UserError(
                f"no checkpoint in '{self.root}'", "train first, or point ckpt.resume (--resume) at a checkpoint directory."
            )
        if "ema.pt" in chosen.files:
            # AveragedModel's state dict is {'module.<name>': ..., 'n_averaged': ...}.
            ema = self._read(chosen.path, "ema.pt")
            weights = {k[len("module."):]: v for k, v in ema.items() if k.startswith("module.")}
        else:
            weights = self._read(chosen.path, "model.pt")
        _load_into(model, weights, chosen.path)
        return Resumed(chosen.path, TrainState.from_dict(chosen.info), int(chosen.info["world_size"]))

    def _choose(self, resume: str) -> _Chosen | None:
        """Rank 0 picks and verifies, and reads state.json; the verdict (the choice, or an error) is broadcast."""
        choice: tuple[str, list[str], dict[str, Any], tuple[str, str]] = ("", [], {}, ("", ""))
        if self.runtime.is_main:
            try:
                chosen, skipped = select_checkpoint(self.root, resume, self.experiment)
                for c in skipped:
                    log.warning("skipping checkpoint %s: %s", c.path, c.problem)
                if chosen is not None:
                    choice = (str(chosen.path), sorted(chosen.manifest["files"]), _read_info(chosen.path), ("", ""))
            except UserError as err:
                choice = ("", [], {}, (str(err.args[0]), err.hint))
            except Exception as err:  # e.g. an I/O error while verifying: it must reach the other ranks too
                choice = ("", [], {}, (f"cannot check the checkpoints under '{self.root}': {type(err).__name__}: "
                                       f"{err}", "fix the file system or point ckpt.resume at another checkpoint."))
        path, files, info, (error, hint) = broadcast_object(choice, self.runtime)
        if error:
            raise on_every_rank(UserError(error, hint))
        return _Chosen(Path(path), frozenset(files), info) if path else None

    def _read(self, path: Path, name: str) -> Any:
        """Collective: a checkpoint file's content on every rank, read from storage once, by rank 0.

        Once per job rather than once per node: the shared file system then serves one checkpoint's worth of
        reads per resume whatever the job's size (every rank reading made 512 ranks x 600 MB = 300 GB; once per
        node would still grow with the node count, and need a node-local communicator besides). The cost is one
        client's read of the file plus the broadcast, about size / link bandwidth whatever the world size (NCCL
        pipelines it along its ring or tree), as for DDP's own broadcast of the module state. The status comes
        first, on the control plane (its wait includes rank 0's read): a missing or unreadable file fails every
        rank with the same message, and none is left waiting."""
        if not self.runtime.distributed:
            return storage.load_file(path, name)
        data, header = None, (0, "")
        if self.runtime.is_main:
            try:
                data = storage.read_bytes(path, name)
                header = (len(data), "")
            except Exception as err:  # noqa: BLE001 - any failure must reach the other ranks
                header = (0, f"{type(err).__name__}: {err}")
        nbytes, error = broadcast_object(header, self.runtime)
        if error:
            raise on_every_rank(_unreadable(path, name, error))
        data = broadcast_bytes(data, nbytes, self.runtime)
        try:
            return storage.load_bytes(data, path, name)
        except UserError as err:  # the same bytes on every rank: the same error on every rank
            raise on_every_rank(err) from None

    def _own_rng(self, path: Path) -> dict[str, Any]:
        """Collective: this rank's entry of rng.pt, which rank 0 reads and scatters (each rank gets its own)."""
        entries: list[tuple[Any, tuple[str, str]]] | None = None
        if self.runtime.is_main:
            try:
                rng = storage.load_file(path, "rng.pt")
                if not isinstance(rng, list) or len(rng) != self.runtime.world_size:
                    raise UserError(f"rng.pt of checkpoint '{path}' holds {len(rng) if isinstance(rng, list) else 'no'} "
                                    f"per-rank entries, not {self.runtime.world_size}",
                                    "resume from another checkpoint (ckpt.resume=PATH) or start a new run.dir.")
                entries = [(entry, ("", "")) for entry in rng]
            except UserError as err:  # load_file's verdict on any failure to read or unpickle
                entries = [(None, (str(err.args[0]), err.hint))] * self.runtime.world_size
        entry, (error, hint) = scatter_objects(entries, self.runtime)
        if error:
            raise on_every_rank(UserError(error, hint))
        return entry

    def _load(self, chosen: _Chosen, stateful: Mapping[str, Any], seed: int) -> Resumed:
        path, info = chosen.path, chosen.info
        state = TrainState.from_dict(info)
        _load_into(stateful["model"], self._read(path, "model.pt"), path)
        optim = self._read(path, "optim.pt")
        for key in ("optimizer", "scheduler"):
            stateful[key].load_state_dict(optim[key])
        _load_scaler(stateful["scaler"], optim["scaler"], path, self.runtime.is_main)
        del optim
        if stateful.get("ema") is not None:
            if "ema.pt" not in chosen.files:
                raise on_every_rank(UserError(f"checkpoint '{path}' has no EMA weights, but optim.ema_decay > 0",
                                              "set optim.ema_decay=0 or start a new run."))
            _load_into(stateful["ema"], self._read(path, "ema.pt"), path)
        if stateful.get("experiment") is not None:
            _load_experiment_state(stateful["experiment"], chosen, self)
        saved_world = int(info["world_size"])
        if saved_world == self.runtime.world_size:
            restore_rng(self._own_rng(path), self.runtime.device)
        else:
            seed_rank_streams(seed, self.runtime.rank, state.step)
            if self.runtime.is_main:
                log.warning(
                    "resuming a run saved by %d processes on %d: data order and position are exact, but the "
                    "per-rank random streams (dropout, noise) are re-seeded from (seed, rank, step)",
                    saved_world, self.runtime.world_size,
                )
        barrier(self.runtime)
        return Resumed(path, state, saved_world)


@dataclass(frozen=True)
class _Chosen:
    """The checkpoint a resume loads, as rank 0 found it (the same on every rank)."""

    path: Path
    files: frozenset[str]
    """The files its manifest lists (verified by rank 0)."""
    info: dict[str, Any]
    """state.json."""


_REREAD_HINT = ("the checkpoint was verified a moment before: it was moved or deleted since, or the file system "
                "failed; resume again, or from another checkpoint (ckpt.resume=PATH).")


def _unreadable(path: Path, name: str, error: str) -> UserError:
    return UserError(f"cannot read {name} from checkpoint '{path}': {error}", _REREAD_HINT)


def _read_info(path: Path) -> dict[str, Any]:
    """state.json, checked for what a resume uses; UserError when unusable."""
    try:
        info = json.loads((path / "state.json").read_text())
        TrainState.from_dict(info)
        int(info["world_size"])
        return info
    except OSError as err:
        raise _unreadable(path, "state.json", f"{type(err).__name__}: {err}") from None
    except (ValueError, KeyError, TypeError) as err:
        raise UserError(f"state.json of checkpoint '{path}' is not usable: {type(err).__name__}: {err}",
                        "resume from another checkpoint (ckpt.resume=PATH) or start a new run.dir.") from None


def _load_scaler(scaler: Any, saved: dict, path: Path, is_main: bool) -> None:
    """A run saved without loss scaling (bf16, fp32) and resumed with it (fp16: precision=auto on an older GPU
    type after a requeue) starts the scale afresh; GradScaler itself refuses an empty state."""
    if scaler.is_enabled() and not saved:
        if is_main:
            log.warning("checkpoint %s was saved without fp16 loss scaling; this launch uses fp16 (train.precision, "
                        "or precision=auto on another GPU type): the loss scale starts afresh", path)
        return
    scaler.load_state_dict(saved)


def _failed(step: int, err: Exception) -> SaveOutcome:
    return SaveOutcome(step, f"{type(err).__name__}: {err}", isinstance(err, OSError))


def _raise_if_failed(outcome: SaveOutcome | None, root: Path) -> None:
    if outcome is None or not outcome.error:
        return
    message = f"saving checkpoint at step {outcome.step} under '{root}' failed: {outcome.error}"
    if outcome.is_io:
        hint = "free disk space or fix the file system, then resume; the previous checkpoint is intact."
        raise on_every_rank(UserError(message, hint))
    raise on_every_rank(RuntimeError(f"{message} (the previous checkpoint is intact)"))


def _load_experiment_state(experiment: Any, chosen: "_Chosen", manager: "Checkpointer") -> None:
    if "experiment.pt" not in chosen.files:
        if manager.runtime.is_main:
            log.warning("checkpoint '%s' holds no experiment state (saved by an experiment version without any): "
                        "the experiment's state starts fresh", chosen.path)
        return
    experiment.load_state_dict(manager._read(chosen.path, "experiment.pt"))


def _load_into(module: nn.Module, state_dict: Mapping[str, Any], path: Path) -> None:
    try:
        module.load_state_dict(state_dict)
    except RuntimeError as err:
        first = str(err).splitlines()[:3]
        raise UserError(
            f"checkpoint '{path}' does not fit this model: {' '.join(first)}",
            "resume with the [model] options the run was started with (see config.toml in the checkpoint), "
            "or use a new run.dir.",
        ) from None
