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
                "lr": _rates(stateful), "objects": object_hashes(stateful)}
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


def _state(obj: Any) -> Any:
    if hasattr(obj, "n_averaged") and hasattr(obj, "module"):  # an EMA copy: its weights and its count
        return {"module": obj.module.state_dict(), "n_averaged": int(obj.n_averaged)}
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
