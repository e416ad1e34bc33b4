"""Saving and restoring a whole training run across ranks, under any dist.strategy, in one format.

The tensors (model, optimizer, EMA) go through torch.distributed.checkpoint: every rank writes its part and
reads back what it holds, so a checkpoint written by W processes under ddp, zero1 or fsdp loads on W' processes
under any of them (state_dicts.py names everything by parameter). hpctrain's guarantees sit around it
(storage.py): a temporary directory renamed when complete, a manifest with every rank's file hashes written
last, ``latest``, keep-last-k, fallback to the previous checkpoint on damage, refusal of another experiment's
checkpoint. The small rest (scheduler, scaler, each rank's random streams, the train state) rank 0 writes, and a
resume reads once and sends to every rank.

This package knows nothing of training: the caller passes the train state's fields and this rank's random
streams, and gets them back (checkpoint/ does not import train/).
"""

from __future__ import annotations

import contextlib
import json
import logging
import shutil
import time
import warnings
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping, TypeVar

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException

from hpctrain.checkpoint import policy, storage
from hpctrain.checkpoint.policy import select_checkpoint
from hpctrain.checkpoint import state_dicts as dcp_state
from hpctrain.checkpoint.background import BackgroundWriter
from hpctrain.checkpoint.snapshot import cpu_snapshot
from hpctrain.checkpoint.storage import Checked
from hpctrain.compat import CheckpointStager
from hpctrain.dist.collectives import (
    barrier, broadcast_bytes, broadcast_object, broadcast_state, gather_objects, gather_to_main, scatter_objects,
)
from hpctrain.dist.runtime import Runtime
from hpctrain.errors import UserError, agreed_on_every_rank, on_every_rank

T = TypeVar("T")

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Resumed:
    path: Path
    info: dict[str, Any]
    """state.json: the train state's fields (step, epoch, step_in_epoch, samples_seen, global_batch_size),
    world_size and strategy."""
    saved_world_size: int
    rng: dict[str, Any] | None = None
    """This rank's random streams as saved, when the world size is unchanged; None otherwise (the caller
    re-seeds them)."""
    parts: frozenset[str] = frozenset()
    """What the checkpoint's DCP part holds: model, optim, ema."""


@dataclass(frozen=True)
class SaveOutcome:
    """What became of one save (rank 0 knows; it is broadcast so every rank acts on it)."""

    step: int
    error: str = ""
    """'' when the checkpoint is complete on disk (or, for a background save, when its copy is taken)."""
    is_io: bool = False
    """The failure was an OSError (full disk, quota, permissions): the user's to fix."""
    refused: bool = False
    """Not committed because ``commit_allowed`` said no (the run dir lock lost): ``error`` says why."""


@dataclass(frozen=True)
class _Save:
    """One save's identity and its rank-0 payload, bound when the save starts (training goes on meanwhile)."""

    step: int
    tmp: Path
    small: dict[str, Any]
    """train.pt: scheduler, scaler, EMA count, experiment state (a CPU copy)."""
    rng: list[Any] | None
    """Every rank's random streams (rank 0), for rng.pt."""
    info: dict[str, Any]
    """state.json."""
    meta: dict[str, Any]
    """The manifest's own fields."""


class Checkpointer:
    """Collective saves and loads of a whole run, in torch.distributed.checkpoint format (see storage.py).

    Every rank writes its own part (dcp/__R_*.distcp) and hashes it; rank 0 gathers the hashes, writes the small
    rank-0 files, the manifest last, renames the directory into place and moves ``latest``. The outcome is
    broadcast, so a failed save (full disk, I/O error) raises on every rank instead of leaving the others waiting.

    With ckpt.async_save, DCP's stager copies the tensors to CPU memory (the whole pause), and a thread of
    hpctrain's per rank writes the copy with DCP, hashes the rank's files and joins rank 0's gather; rank 0's thread
    finishes the checkpoint. (What dcp.async_save does, but in a thread at low priority, see background.py.)
    Those threads' collectives run on a gloo group of their own: on the default group, or the control plane, they
    would interleave with the training loop's (measured: a deadlock). The outcome reaches every rank at the next
    save or when the loop ends (settle).
    """

    def __init__(
        self, run_dir: Path, experiment: str, runtime: Runtime, config_text: str, keep_last: int,
        async_save: bool = False, strategy: str = "ddp", control_timeout_s: float = 3600.0,
    ) -> None:
        self.root = run_dir / "checkpoints"
        self.experiment = experiment
        self.runtime = runtime
        self.config_text = config_text
        self.keep_last = keep_last
        self.async_save = async_save
        self.strategy = strategy
        self._writer: BackgroundWriter[SaveOutcome] = BackgroundWriter()
        self.commit_allowed: Callable[[], str] | None = None
        """Rank 0 asks it right before a checkpoint is renamed into place and ``latest`` moved (also in the background
        writer, which may finish after the training stopped): '' to commit, else why not (train/run.py passes the run
        dir lock's check: a save begun before another training took the run dir is dropped, not committed)."""
        self.committed_step = 0
        """The step of the newest checkpoint this run can resume from: the one restored, then each one committed (on
        rank 0, also by the background writer). Records up to it can no longer be redone by a resume, so the
        experiment trackers may send them (metrics/trackers)."""
        self._stager: CheckpointStager | None = None
        # Made here, when every rank builds its Checkpointer at the same point (new_group is a collective).
        self._async_group = None
        if async_save and runtime.distributed:
            self._async_group = dist.new_group(backend="gloo", timeout=timedelta(seconds=control_timeout_s))

    # ---- saving -------------------------------------------------------------------------------------------

    def save(self, info: Mapping[str, Any], stateful: Mapping[str, Any], rng: Any, wait: bool = False) -> None:
        """Collective: every rank calls it at the same step, with the train state's fields (``info``) and its own
        random streams (``rng``). With async_save (and not ``wait``) training pauses only for the copy to CPU. A
        save first waits for the previous background write, and a failure of that write raises here, on every
        rank."""
        self.settle()
        started = time.perf_counter()
        job = self._begin(info, stateful, rng)
        tensors, error = _local(lambda: dcp_state.tensor_state(stateful))
        if not all(ok for ok in gather_objects(not error, self.runtime)):  # no rank enters DCP's collectives alone
            self._finish(job, {}, error or "another rank failed to collect its state", None)  # raises everywhere
            return
        if self.async_save and not wait:
            self._save_in_background(job, tensors, started)
        else:
            entries, error = _local(lambda: self._write_tensors(job.tmp, tensors))
            self._finish(job, entries or {}, error, None, started)

    def settle(self) -> None:
        """Collective: wait for a background write still running; its failure raises on every rank.
        The training loop calls it before it leaves, so a finished run's checkpoint is on disk."""
        if not self.async_save:
            return
        outcome = self._writer.wait()  # rank 0's thread returns the outcome; the others' return None
        _raise_if_failed(broadcast_object(outcome, self.runtime), self.root)

    def drain(self) -> None:
        """Wait (this rank only, no collective) for a background write still running: a failing run lets it finish
        before the run dir lock is released, so it cannot commit into a run dir another training took since."""
        with contextlib.suppress(Exception):
            self._writer.wait()

    def close(self) -> None:
        """Release the staging buffers (after the last settle)."""
        if self._stager is not None:
            self._stager.close()
            self._stager = None

    def _begin(self, info: Mapping[str, Any], stateful: Mapping[str, Any], rng: Any) -> _Save:
        """Rank 0 makes the save's temporary directory and takes the small state; every rank learns the directory
        (or rank 0's failure, raised everywhere)."""
        step = int(info["step"])
        rngs = gather_to_main(rng, self.runtime)
        made: tuple[str, str, bool] = ("", "", False)
        small: dict[str, Any] = {}
        if self.runtime.is_main:
            try:
                small = cpu_snapshot(dcp_state.small_state(stateful))  # training changes the live state next step
                made = (str(storage.new_temporary(self.root, step)), "", False)
            except Exception as err:  # must reach the other ranks, not leave them waiting
                made = ("", f"{type(err).__name__}: {err}", isinstance(err, OSError))
        tmp, error, is_io = broadcast_object(made, self.runtime)
        if error:
            _raise_if_failed(SaveOutcome(step, error, is_io), self.root)
        meta = {"experiment": self.experiment, "epoch": int(info["epoch"]), "world_size": self.runtime.world_size,
                "strategy": self.strategy, "parts": sorted(["model", "optim"] + (["ema"] if dcp_state.has_ema(stateful) else []))}
        state_json = dict(info) | {"world_size": self.runtime.world_size, "strategy": self.strategy}
        if "emas" in stateful:  # several models, some averaged: which ones the ema part holds (the shipped weights)
            state_json["ema_models"] = sorted(stateful["emas"])
        return _Save(step, Path(tmp), small, rngs, state_json, meta)

    def _write_tensors(self, tmp: Path, tensors: dict[str, Any], group: Any = None) -> dict[str, Any]:
        """Collective (DCP's own plan and result exchange, on the control plane or ``group``): every rank writes its
        part; returns this rank's manifest entries. An exception on any rank is raised by DCP on every rank."""
        with _single_process_is_meant():
            dcp.save(tensors, storage_writer=FileSystemWriter(str(tmp / dcp_state.DCP_DIR)),
                     planner=dcp_state.save_planner(), process_group=group or self.runtime.control,
                     no_dist=not self.runtime.distributed)
        return self._hash_own(tmp)

    def _hash_own(self, tmp: Path) -> dict[str, Any]:
        """The files this rank wrote (DCP names them __<rank>_<n>.distcp; rank 0 also writes .metadata), hashed by
        this rank: the manifest's checksums cost every rank a read of its own part, not rank 0 a read of all."""
        folder = tmp / dcp_state.DCP_DIR
        mine = sorted(folder.glob(f"__{self.runtime.rank}_*.distcp"))
        if self.runtime.is_main:
            mine.append(folder / ".metadata")
        return {f"{dcp_state.DCP_DIR}/{p.name}": storage.hash_file(p) for p in mine}

    def _save_in_background(self, job: _Save, tensors: dict[str, Any], started: float) -> None:
        if self._stager is None:
            self._stager = CheckpointStager(cuda=self.runtime.device.type == "cuda")
        staged, error = _local(lambda: self._stager.stage(tensors))  # the whole pause: a copy, then training goes on
        paused = time.perf_counter() - started
        # Whether every rank has its copy: a rank without one would leave the others' writes waiting in DCP.
        if not all(ok for ok in gather_objects(not error, self.runtime)):
            self._finish(job, {}, error or "another rank failed to copy its state", None)  # raises everywhere
            return

        def complete() -> SaveOutcome:
            # DCP's save of the copy, in hpctrain's writer thread at low priority: on few cores the write competes
            # with training, and dcp.async_save's own thread runs at normal priority (measured on 2 cores with the
            # DDPM state: training steps 3.7x slower during its write, 1.5x during this one; BENCHMARKS.md). Its
            # collectives run on the writers' own group.
            entries, error = _local(lambda: self._write_tensors(job.tmp, staged, self._async_group))
            return self._complete(job, entries or {}, error, self._async_group, time.perf_counter() - started, paused)

        self._writer.submit(complete)

    def _finish(self, job: _Save, entries: dict[str, Any], error: str, group: Any, started: float | None = None) -> None:
        """Collective (control plane): complete a synchronous save, or raise its failure on every rank."""
        seconds = time.perf_counter() - started if started is not None else 0.0
        outcome = self._complete(job, entries, error, group, seconds, None)
        _raise_if_failed(broadcast_object(outcome, self.runtime), self.root)

    def _complete(self, job: _Save, entries: dict[str, Any], error: str, group: Any, seconds: float,
                  paused: float | None) -> SaveOutcome | None:
        """Collective on ``group`` (the control plane, or the background writers' own): rank 0 gathers every rank's
        file hashes or error, and finishes the checkpoint or drops it; returns the outcome on rank 0, None elsewhere.
        Never raises: it may run in a thread."""
        try:
            parts = gather_to_main((entries, error), self.runtime, group)
        except Exception as err:  # the group failed (a rank died): rank 0 cannot finish this one
            parts, error = None, f"gathering the ranks' file hashes failed: {type(err).__name__}: {err}"
            if self.runtime.is_main:
                storage.discard(job.tmp)
                return _failed(job.step, RuntimeError(error))
        if not self.runtime.is_main:
            return None
        return self._write_rest(job, parts or [], seconds, paused)

    def _write_rest(self, job: _Save, parts: list[tuple[dict[str, Any], str]], seconds: float,
                    paused: float | None) -> SaveOutcome:
        errors = [f"rank {rank}: {err}" for rank, (_, err) in enumerate(parts) if err]
        if errors:
            storage.discard(job.tmp)
            return SaveOutcome(job.step, "; ".join(errors[:3]), any("[Errno" in e for e in errors))
        try:
            files = {dcp_state.TRAIN_FILE: job.small, "rng.pt": job.rng, "config.toml": self.config_text,
                     "state.json": json.dumps(job.info, indent=1)}
            merged = {name: entry for rank_entries, _ in parts for name, entry in rank_entries.items()}
            merged |= storage.write_files(job.tmp, files)
            commit = {"commit_allowed": self.commit_allowed} if self.commit_allowed is not None else {}
            path = storage.finish_checkpoint(self.root, job.tmp, job.step, merged, job.meta, **commit)
            self.committed_step = max(self.committed_step, job.step)
            self._retire_old(path)
        except storage.CommitRefused as err:
            log.error("checkpoint of step %d not committed: %s", job.step, err)
            return SaveOutcome(job.step, str(err), refused=True)
        except Exception as err:
            storage.discard(job.tmp)
            return _failed(job.step, err)
        size = sum(e["bytes"] for e in merged.values()) / 1e6
        if paused is None:
            log.info("saved checkpoint %s (%.1f MB in %.0f ms)", path, size, seconds * 1000)
        else:
            log.info("saved checkpoint %s (%.1f MB; training paused %.0f ms for the copy, written in the background "
                     "in %.0f ms)", path, size, paused * 1000, seconds * 1000)
        return SaveOutcome(job.step)

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

    # ---- loading ------------------------------------------------------------------------------------------

    def restore(self, resume: str, stateful: Mapping[str, Any]) -> Resumed | None:
        """Collective: rank 0 picks and verifies the checkpoint; every rank loads what it holds of it (DCP reads
        each rank's shards, resharding from any world size and strategy). None for a fresh start."""
        chosen = self._choose(resume)
        return self._load(chosen, stateful) if chosen else None

    def restore_weights(self, resume: str, model: nn.Module, weights: str = "auto") -> Resumed:
        """Collective (the choice): load only one set of weights into a plain module: ``weights`` auto (the EMA ones
        when the checkpoint has them), ema, or model (the training weights). Each process reads them itself, without
        a process group (eval, sample, predict, export), from a checkpoint of any strategy and world size."""
        chosen = self._choose(resume)
        if chosen is None:
            raise UserError(
                f"no checkpoint in '{self.root}'", "train first, or point ckpt.resume (--resume) at a checkpoint directory."
            )
        part = ("ema" if "ema" in chosen.parts else "model") if weights == "auto" else weights
        if part not in chosen.parts:
            raise on_every_rank(UserError(f"checkpoint '{chosen.path}' holds no EMA weights (the run had "
                                          "optim.ema_decay=0)", "export the training weights instead (no --ema)."))
        averaged = chosen.info.get("ema_models")
        if part == "ema" and averaged is not None and isinstance(model, nn.ModuleDict):
            # Several models, EMA copies of some: each model's averaged weights where it has them, else its own.
            self._load_weights(chosen.path, "model", model)
            self._load_weights(chosen.path, "ema", nn.ModuleDict({name: model[name] for name in averaged}))
        else:
            self._load_weights(chosen.path, part, model)
        return Resumed(chosen.path, chosen.info, int(chosen.info["world_size"]), parts=frozenset({part}))

    def _load_weights(self, path: Path, part: str, model: nn.Module) -> None:
        template = {part: dcp_state.model_weights(model)}
        self._dcp_load(path, template, no_dist=True)
        _fit(lambda: dcp_state.set_model_weights(model, template[part]), path, self.config_text)

    def _load(self, chosen: _Chosen, stateful: Mapping[str, Any]) -> Resumed:
        path, info = chosen.path, chosen.info
        self.committed_step = int(info.get("step", 0))
        full = stateful
        start_ema = dcp_state.has_ema(stateful) and "ema" not in chosen.parts  # EMA turned on at this resume
        if start_ema:
            stateful = dcp_state.without_ema(stateful)
        elif not dcp_state.has_ema(stateful) and "ema" in chosen.parts and self.runtime.is_main:
            log.warning("checkpoint %s holds EMA weights, but optim.ema_decay=0: they are not carried on (this run "
                        "validates and saves the training weights only); resume with optim.ema_decay>0 to keep them",
                        path)
        template = dcp_state.tensor_state(stateful)
        optimized, with_state = self._saved_optimizer_params(path)
        dcp_state.drop_unsaved_optimizer_state(stateful, template, with_state)
        stateless = sorted(optimized - with_state)
        if stateless and self.runtime.is_main:
            log.info("checkpoint %s holds no optimizer state for %d parameter(s) that never had a gradient (%s): they "
                     "resume without state, as in the uninterrupted run", path, len(stateless),
                     ", ".join(stateless[:3]) + (", ..." if len(stateless) > 3 else ""))
        replicated = dcp_state.REPLICATED[self.strategy]
        self._load_once_and_broadcast(path, {k: v for k, v in template.items() if k in replicated})
        sharded = {k: v for k, v in template.items() if k not in replicated}
        if sharded:
            self._dcp_load(path, sharded, no_dist=False)
        _fit(lambda: dcp_state.apply_tensor_state(stateful, template), path, self.config_text)
        self._load_small(chosen, stateful)
        if start_ema:
            _start_emas(full, path, int(info["step"]), self.runtime.is_main)
        saved_world = int(info["world_size"])
        rng = self._own_rng(path) if saved_world == self.runtime.world_size else None
        saved_strategy = info.get("strategy", "ddp")
        if saved_strategy != self.strategy and self.runtime.is_main:
            log.info("checkpoint %s was written under dist.strategy=%s by %d process(es); resharded for %s on %d",
                     path, saved_strategy, saved_world, self.strategy, self.runtime.world_size)
        barrier(self.runtime)
        return Resumed(path, info, saved_world, rng, chosen.parts)

    def _saved_optimizer_params(self, path: Path) -> tuple[set[str], set[str]]:
        """Collective: state_dicts.saved_optimizer_params of the checkpoint's DCP metadata, which rank 0 reads (once,
        not once per rank) and broadcasts."""
        names: tuple[list[str], list[str]] = ([], [])
        error = ""
        if self.runtime.is_main:
            try:
                metadata = FileSystemReader(str(path / dcp_state.DCP_DIR)).read_metadata()
                optimized, with_state = dcp_state.saved_optimizer_params(metadata.state_dict_metadata)
                names = (sorted(optimized), sorted(with_state))
            except Exception as err:  # noqa: BLE001 - any failure must reach the other ranks
                error = f"cannot read the DCP metadata of checkpoint '{path}': {type(err).__name__}: {err}"
        if self.runtime.distributed:
            names, error = broadcast_object((names, error), self.runtime)
        if error:
            raise on_every_rank(UserError(error, "resume from another checkpoint (ckpt.resume=PATH) or use a new "
                                                 "run.dir."))
        return set(names[0]), set(names[1])

    def _load_once_and_broadcast(self, path: Path, template: dict[str, Any]) -> None:
        """The parts every rank holds whole (the model under ddp and zero1, the optimizer under ddp): rank 0 reads
        them, once, and broadcasts them over the training group, as DDP broadcasts its initial weights. With every
        rank reading, a resume of 512 ranks would read 512 copies from the shared file system."""
        if not template:
            return
        if not self.runtime.distributed:
            self._dcp_load(path, template, no_dist=True)
            return
        error: tuple[str, str] = ("", "")
        if self.runtime.is_main:
            try:
                self._dcp_load(path, template, no_dist=True)
            except UserError as err:
                error = (str(err.args[0]), err.hint)
        message, hint = broadcast_object(error, self.runtime)
        if message:
            raise on_every_rank(UserError(message, hint))
        broadcast_state(template, self.runtime)

    def _dcp_load(self, path: Path, template: dict[str, Any], no_dist: bool) -> None:
        """DCP fills ``template``'s tensors in place from the checkpoint; every rank reads only what it holds. DCP
        raises a failure (a missing name, a shape that does not fit, an unreadable file) on every rank."""
        try:
            with _single_process_is_meant():
                dcp.load(template, storage_reader=FileSystemReader(str(path / dcp_state.DCP_DIR)),
                         planner=dcp_state.SafeLoadPlanner(), process_group=None if no_dist else self.runtime.control,
                         no_dist=no_dist or not self.runtime.distributed)
        except (Exception, CheckpointException) as err:  # DCP's exception wraps each rank's failure
            first = describe_error(err)[:600]
            raise on_every_rank(UserError(
                f"cannot load checkpoint '{path}' into this run: {first}",
                changed_settings(path, self.config_text) + "resume with the [model] options the run was started with "
                "(see config.toml in the checkpoint), or from another checkpoint (ckpt.resume=PATH), or use a new "
                "run.dir.")) from None

    def _load_small(self, chosen: _Chosen, stateful: Mapping[str, Any]) -> None:
        small = self._read(chosen.path, dcp_state.TRAIN_FILE)
        if "optimizers" in stateful:
            self._load_named(chosen.path, small, stateful)
        else:
            stateful["scheduler"].load_state_dict(small["scheduler"])
            _load_scaler(stateful["scaler"], small["scaler"], chosen.path, self.runtime.is_main)
            if stateful.get("ema") is not None:
                stateful["ema"].n_averaged.fill_(int(small.get("ema_n_averaged", 1)))
        if stateful.get("experiment") is not None:
            if "experiment" not in small:
                if self.runtime.is_main:
                    log.warning("checkpoint '%s' holds no experiment state (saved by an experiment version without "
                                "any): the experiment's state starts fresh", chosen.path)
            else:
                stateful["experiment"].load_state_dict(small["experiment"])

    def _load_named(self, path: Path, small: dict[str, Any], stateful: Mapping[str, Any]) -> None:
        """Several optimizers' schedulers and scalers, EMA counts and registered objects, each by its name. A name
        this run has and the checkpoint lacks (or the other way) is a run that does not fit the checkpoint."""
        for kind, saved_key in (("schedulers", "schedulers"), ("scalers", "scalers"), ("objects", "objects")):
            live, saved = stateful.get(kind, {}), small.get(saved_key, {})
            if set(live) != set(saved):
                raise on_every_rank(UserError(
                    f"checkpoint '{path}' holds the {kind} {sorted(saved)}, this run registers {sorted(live)}",
                    "register the same objects under the same names as the run that saved it (a name added or "
                    "removed changes what resumes), or start a new run.dir."))
            for name, obj in live.items():
                if kind == "scalers":
                    _load_scaler(obj, saved[name], path, self.runtime.is_main)
                else:
                    _fit(lambda obj=obj, state=saved[name]: obj.load_state_dict(state), path, self.config_text)
        counts = small.get("ema_n_averaged", {})
        for name, ema in stateful.get("emas", {}).items():
            if name in counts:
                ema.n_averaged.fill_(int(counts[name]))

    def _choose(self, resume: str) -> _Chosen | None:
        """Rank 0 picks and verifies, and reads state.json; the verdict (the choice, or an error) is broadcast."""
        choice: tuple[str, list[str], dict[str, Any], tuple[str, str]] = ("", [], {}, ("", ""))
        if self.runtime.is_main:
            try:
                chosen, skipped = select_checkpoint(self.root, resume, self.experiment)
                for c in skipped:
                    log.warning("skipping checkpoint %s: %s", c.path, c.problem)
                if chosen is not None:
                    choice = (str(chosen.path), list(chosen.manifest.get("parts", [])), _read_info(chosen.path),
                              ("", ""))
            except UserError as err:
                choice = ("", [], {}, (str(err.args[0]), err.hint))
            except Exception as err:  # e.g. an I/O error while verifying: it must reach the other ranks too
                choice = ("", [], {}, (f"cannot check the checkpoints under '{self.root}': {type(err).__name__}: "
                                       f"{err}", "fix the file system or point ckpt.resume at another checkpoint."))
        path, parts, info, (error, hint) = broadcast_object(choice, self.runtime)
        if error:
            raise on_every_rank(UserError(error, hint))
        return _Chosen(Path(path), frozenset(parts), info) if path else None

    def _read(self, path: Path, name: str) -> Any:
        """Collective: a small rank-0 file's content (train.pt) on every rank, read from storage once, by rank 0,
        and broadcast: the same bytes, so the same state or the same error everywhere. The status comes first, on
        the control plane: a missing or unreadable file fails every rank with the same message."""
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
            raise agreed_on_every_rank(_unreadable(path, name, error))
        data = broadcast_bytes(data, nbytes, self.runtime)
        try:
            return storage.load_bytes(data, path, name)
        except UserError as err:  # the same bytes on every rank: the same error on every rank
            raise agreed_on_every_rank(err) from None

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


@contextlib.contextmanager
def _single_process_is_meant() -> Iterator[None]:
    """DCP warns on every save and load without a process group, even when asked for exactly that (no_dist)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        yield


def _local(work: Callable[[], T]) -> tuple[T | None, str]:
    """Run ``work``; (its result, '') or (None, the error) for the other ranks to hear of."""
    try:
        return work(), ""
    except (Exception, CheckpointException) as err:  # noqa: BLE001 - any failure must reach the other ranks
        return None, describe_error(err)


def describe_error(err: BaseException) -> str:
    """One line per failure. DCP's CheckpointException (a BaseException, not an Exception) carries each failed
    rank's exception; an OSError among them is named as '[Errno N] ...', which marks the failure as the user's
    to fix (full disk, quota, permissions)."""
    if isinstance(err, CheckpointException):
        parts = []
        for rank, (exc, _) in sorted(err.failures.items())[:3]:
            errno = f"[Errno {exc.errno}] " if isinstance(exc, OSError) and exc.errno else ""
            parts.append(f"rank {rank}: {type(exc).__name__}: {errno}{exc.strerror if errno else exc}")
        return "; ".join(parts)
    return f"{type(err).__name__}: {err}"


@dataclass(frozen=True)
class _Chosen:
    """The checkpoint a resume loads, as rank 0 found it (the same on every rank)."""

    path: Path
    parts: frozenset[str]
    """What its DCP part holds: model, optim, and ema when the run had EMA weights."""
    info: dict[str, Any]
    """state.json."""


_REREAD_HINT = ("the checkpoint was verified a moment before: it was moved or deleted since, or the file system "
                "failed; resume again, or from another checkpoint (ckpt.resume=PATH).")


def _unreadable(path: Path, name: str, error: str) -> UserError:
    return UserError(f"cannot read {name} from checkpoint '{path}': {error}", _REREAD_HINT)


INFO_FIELDS = ("step", "epoch", "step_in_epoch", "samples_seen", "world_size")


def _start_emas(stateful: Mapping[str, Any], path: Path, step: int, is_main: bool) -> None:
    """optim.ema_decay > 0 on a checkpoint saved without an EMA: the EMA starts from the restored weights (its first
    update, a copy), as a run that turned it on at this step; validation and the shipped weights use it from now.
    Several EMAs (``emas``) each start from their own model (``ema_models``, by the same name)."""
    if "emas" in stateful:
        pairs = [(ema, stateful["ema_models"][name]) for name, ema in stateful["emas"].items()]
    else:
        pairs = [(stateful["ema"], stateful["model"])]
    for ema, model in pairs:
        ema.n_averaged.zero_()
        ema.update_parameters(model)
    if is_main:
        log.info("checkpoint %s holds no EMA weights (saved with optim.ema_decay=0): the EMA starts from the restored "
                 "weights at step %d", path, step)


def _read_info(path: Path) -> dict[str, Any]:
    """state.json, checked for what a resume uses; UserError when unusable."""
    try:
        info = json.loads((path / "state.json").read_text())
        for key in INFO_FIELDS:
            int(info[key])
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
    if outcome.refused:
        raise on_every_rank(UserError(
            f"checkpoint of step {outcome.step} not committed under '{root}': the run dir lock is no longer this "
            f"run's ({outcome.error})", "another training may be writing this run dir: let it finish or stop it, "
            "then resume from the run dir's latest checkpoint."))
    if outcome.is_io:
        hint = "free disk space or fix the file system, then resume; the previous checkpoint is intact."
        raise on_every_rank(UserError(message, hint))
    raise on_every_rank(RuntimeError(f"{message} (the previous checkpoint is intact)"))


def _fit(load: Callable[[], None], path: Path, config_text: str) -> None:
    """Run a load into the live model; a strict key or shape mismatch (the same on every rank) becomes a message
    that says what to do."""
    try:
        load()
    except (RuntimeError, KeyError, ValueError) as err:
        first = str(err).splitlines()[:3]
        raise on_every_rank(UserError(
            f"checkpoint '{path}' does not fit this model: {' '.join(first)}",
            changed_settings(path, config_text) + "resume with the [model] options the run was started with (see "
            "config.toml in the checkpoint), or use a new run.dir.",
        )) from None


def changed_settings(path: Path, config_text: str) -> str:
    """'model.hidden is 8 here but 16 in the checkpoint; ' for the settings of this run that differ from those the
    checkpoint was saved with (its config.toml), [model] first; '' when they cannot be compared."""
    from hpctrain.config.changes import saved_config, setting_changes

    saved = saved_config(path)
    if saved is None:
        return ""
    changed = setting_changes(saved, config_text)
    changed.sort(key=lambda item: (not item[0].startswith("model."), item[0]))
    if not changed:
        return ""
    parts = [f"{key} is {now} here but {then} in the checkpoint" for key, then, now in changed[:5]]
    more = f" (and {len(changed) - 5} more)" if len(changed) > 5 else ""
    return "; ".join(parts) + more + ": "
