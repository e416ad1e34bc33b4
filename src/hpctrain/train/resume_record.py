"""Per-step records for `hpctrain check resume` (hpctrain/check_resume.py): what each rank trained on and what every
checkpointed object held after each optimizer step, so that an uninterrupted run and a stopped-and-resumed one can
be compared step by step and object by object.

Only a run the check starts records (HPCTRAIN_RESUME_RECORD names the folder); every other run gets an inactive
recorder, whose calls do nothing. A record is one JSON line per step in ``rank_N.jsonl``: the step, a hash of the
micro-batches this rank fetched for it (their tensors' bytes), each optimizer's learning rates, and a hash of each
object's state (models, optimizers, schedulers, loss scalers, EMA copies, registered objects) after the step.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any, Mapping

import torch
from torch import nn

from hpctrain.checkpoint.state_dicts import local_optimizer
from hpctrain.dist.env import resume_record_dir


class ResumeRecorder:
    def __init__(self, path: Path | None) -> None:
        self.path = path
        self._file = None
        self._batches = hashlib.sha256()
        self._batch_count = 0

    @classmethod
    def from_environment(cls, rank: int) -> "ResumeRecorder":
        folder = resume_record_dir()
        return cls(Path(folder) / f"rank_{rank}.jsonl" if folder else None)

    def __bool__(self) -> bool:
        return self.path is not None

    def saw(self, batch: Any) -> None:
        """A micro-batch this rank fetched (as the loader gave it), for the step being trained."""
        if self.path is None:
            return
        _feed(self._batches, batch)
        self._batch_count += 1

    def record(self, step: int, stateful: Mapping[str, Any]) -> None:
        """The line of optimizer step ``step`` (steps done), with the state after it."""
        if self.path is None:
            return
        line = {"step": step, "batches": self._batches.hexdigest()[:16], "micro_batches": self._batch_count,
                "lr": _rates(stateful), "objects": object_hashes(stateful), "parameters": parameter_hashes(stateful)}
        self._batches, self._batch_count = hashlib.sha256(), 0
        if self._file is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._file = open(self.path, "a", encoding="utf-8")
        self._file.write(json.dumps(line, sort_keys=True) + "\n")
        self._file.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


def object_hashes(stateful: Mapping[str, Any]) -> dict[str, str]:
    """A short hash of each checkpointed object's state, by the name a checkpoint gives it."""
    out: dict[str, str] = {}
    for key, value in stateful.items():
        if value is None or key == "ema_models":
            continue
        if isinstance(value, nn.ModuleDict):
            out |= {f"{key}.{name}": _hash(module.state_dict()) for name, module in value.items()}
        elif isinstance(value, Mapping):
            out |= {f"{key}.{name}": _hash(_state(obj)) for name, obj in value.items()}
        else:
            out[key] = _hash(_state(value))
    return out


def parameter_hashes(stateful: Mapping[str, Any]) -> dict[str, str]:
    """The same for the models' and EMA copies' parameters alone: a rank's buffers (batch-norm statistics of its own
    batches) are not what a checkpoint holds for it (rank 0's copy is), but its parameters are."""
    out: dict[str, str] = {}
    for key, value in stateful.items():
        modules = value.items() if isinstance(value, (nn.ModuleDict, Mapping)) else [(None, value)]
        for name, module in modules:
            module = getattr(module, "module", module) if hasattr(module, "n_averaged") else module
            if isinstance(module, nn.Module) and key != "ema_models":
                out[key if name is None else f"{key}.{name}"] = _hash(dict(module.named_parameters()))
    return out


def _state(obj: Any) -> Any:
    if hasattr(obj, "n_averaged") and hasattr(obj, "module"):  # an EMA copy: its weights and its count
        return {"module": obj.module.state_dict(), "n_averaged": int(obj.n_averaged)}
    if isinstance(obj, torch.optim.Optimizer):
        # ZeRO's state_dict is a collective consolidation onto one rank; this rank's partition is what it holds.
        return local_optimizer(obj).state_dict()
    return obj.state_dict()


def _rates(stateful: Mapping[str, Any]) -> dict[str, list[float]]:
    optimizers = stateful.get("optimizers")
    if optimizers is None:
        optimizers = {"optimizer": stateful["optimizer"]} if stateful.get("optimizer") is not None else {}
    return {name: [float(g["lr"]) for g in o.param_groups] for name, o in optimizers.items()}


def _hash(state: Any) -> str:
    digest = hashlib.sha256()
    _feed(digest, state)
    return digest.hexdigest()[:16]


def _feed(digest: Any, value: Any) -> None:
    """Every tensor's bytes (a DTensor's local shard) and every other value's repr, in a fixed order."""
    if isinstance(value, torch.Tensor):
        local = value.to_local() if hasattr(value, "to_local") else value
        digest.update(str((tuple(local.shape), str(local.dtype))).encode())
        digest.update(local.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    elif isinstance(value, Mapping):
        for key in sorted(value, key=str):
            digest.update(str(key).encode())
            _feed(digest, value[key])
    elif isinstance(value, (list, tuple)):
        for item in value:
            _feed(digest, item)
    elif callable(value):  # a LambdaLR's function is not state
        digest.update(b"<callable>")
    else:
        digest.update(repr(value).encode())


VOLATILE = frozenset({"time", "samples_per_s", "eta_s", "data_wait_frac", "gpu_busy"})
"""Train record fields that differ between two runs of the same training (the clock's)."""


def read_records(folder: Path) -> dict[int, dict[int, dict[str, Any]]]:
    """rank -> step -> record, from a recorded run's rank_N.jsonl files (a later launch's line for a step wins)."""
    out: dict[int, dict[int, dict[str, Any]]] = {}
    for path in sorted(folder.glob("rank_*.jsonl")):
        rank = int(path.stem.split("_")[1])
        for line in path.read_text(encoding="utf-8").splitlines():
            if line.strip():
                record = json.loads(line)
                out.setdefault(rank, {})[int(record["step"])] = record
    return out


def first_difference(straight: dict[int, dict[int, dict[str, Any]]], resumed: dict[int, dict[int, dict[str, Any]]],
                     straight_metrics: list[dict[str, Any]], resumed_metrics: list[dict[str, Any]]) -> str:
    """The first step at which the resumed run differs from the uninterrupted one, and what differs there ('' when
    they are the same at every step): the micro-batches a rank trained on, an optimizer's learning rate, a
    checkpointed object's state (by name), or a logged value. Ranks are compared with the same rank when both runs
    had the same number (else rank 0 only: another world size splits the batches otherwise)."""
    ranks = sorted(set(straight) & set(resumed)) if set(straight) == set(resumed) else [0]
    steps = sorted(set().union(*(straight.get(r, {}) for r in ranks)))
    logged = {r["step"]: r for r in straight_metrics if r.get("split") == "train"}
    logged_again = {r["step"]: r for r in resumed_metrics if r.get("split") == "train"}
    for step in steps:
        for rank in ranks:
            a, b = straight.get(rank, {}).get(step), resumed.get(rank, {}).get(step)
            if a is None or b is None:
                return f"step {step}: rank {rank} has no record in the {'resumed' if b is None else 'uninterrupted'} run"
            what = _difference(a, b, same_world=set(straight) == set(resumed), rank=rank)
            if what:
                return f"step {step}, rank {rank}: {what}"
        what = _logged_difference(logged.get(step), logged_again.get(step), exact=set(straight) == set(resumed))
        if what:
            return f"step {step}: {what}"
    return ""


def _changed(a: dict[str, str], b: dict[str, str]) -> list[str]:
    return [name for name in sorted(set(a) | set(b)) if a.get(name) != b.get(name)]


def _difference(a: dict[str, Any], b: dict[str, Any], same_world: bool, rank: int = 0) -> str:
    if same_world and a["batches"] != b["batches"]:
        return ("the micro-batches differ: the data's position is not restored on resume (a sampler, data loader or "
                "iterable of the script's own, or a global random draw in the data)")
    for name in sorted(set(a["lr"]) | set(b["lr"])):
        if a["lr"].get(name) != b["lr"].get(name):
            return (f"the learning rate of optimizer '{name}' differs ({a['lr'].get(name)} uninterrupted, "
                    f"{b['lr'].get(name)} resumed): its schedule did not resume (a scheduler that is not registered?)")
    if not same_world:  # another split of the batches: other float rounding, other shards; the losses say it
        return ""
    changed = _changed(a["objects"], b["objects"])
    if rank:  # a checkpoint holds rank 0's buffers for every rank: only the parameters of a module are this rank's
        changed = [n for n in changed if n not in a.get("parameters", {})] + \
            _changed(a.get("parameters", {}), b.get("parameters", {}))
    if changed:
        return (f"the state of {', '.join(repr(n) for n in changed)} differs after this step (state that is not "
                "registered, a random draw that is not restored, or a nondeterministic operation)")
    return ""


RELATIVE = 1e-5
"""How close a logged value must be after a resume on another number of processes (float summation order)."""


def _logged_difference(a: dict[str, Any] | None, b: dict[str, Any] | None, exact: bool = True) -> str:
    if a is None or b is None:
        return "" if a is b else f"the train record is missing in the {'resumed' if b is None else 'uninterrupted'} run"
    for key in sorted((set(a) | set(b)) - VOLATILE):
        x, y = a.get(key), b.get(key)
        close = isinstance(x, float) and isinstance(y, float) and abs(x - y) <= RELATIVE * max(abs(x), abs(y))
        if x != y and (exact or not close):
            return f"the logged {key} differs ({a.get(key)} uninterrupted, {b.get(key)} resumed)"
    return ""
