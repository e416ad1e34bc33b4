"""What a multi-model step or a user's loop trains, by name: models (as wrapped per dist.strategy, and their own
modules), optimizers, schedulers, loss scalers, EMA copies, and any other object with state. A checkpoint holds
every one of them by its name (checkpoint/state_dicts.py's named form); a resume needs the same names.

Registration is checked as it happens, so a mistake is a message where it was made, not a resume that silently
continues another run: a model wrapped twice, an object without state, a name used twice, an optimizer over
parameters of no registered model (built before run.wrap under fsdp), a scheduler of no registered optimizer.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.nn.parallel import DistributedDataParallel as DDP

from hpctrain.errors import UserError, agreed_on_every_rank

SCHEDULER_TYPES: tuple[type, ...] = (torch.optim.lr_scheduler.LRScheduler, torch.optim.lr_scheduler.ReduceLROnPlateau)


def misuse(message: str, hint: str) -> UserError:
    """Bad use of the session API. Not marked on_every_rank, though the same code runs on every rank: whether a
    rank raises it may depend on its data or on rank-dependent code, and a rank that waited at the leaving
    barrier for peers still training would wait for dist.control_timeout_s. Each rank leaves at once instead
    (without tearing down the process group; see dist/runtime.py shutdown)."""
    return UserError(message, hint)


def agreed_misuse(message: str, hint: str) -> UserError:
    """Bad use found by a collective (every rank holds the same verdict): the ranks meet to leave, and rank 0
    alone says it."""
    return agreed_on_every_rank(UserError(message, hint))


@dataclass
class Wrapped:
    """One model as run.wrap made it."""

    raw: nn.Module
    """The model's own module: what checkpoints, clipping and evaluation use (FSDP2 shards it in place)."""
    wrapped: nn.Module
    """What the forward runs on: DDP, FSDP2 or the module itself, under torch.compile when configured."""
    ema: Any = None
    """Its EMA copy (train/ema.py), or None."""
    trainable: bool = True
    """It has parameters that require a gradient (a frozen teacher has none: placed, never wrapped)."""


@dataclass
class NamedObjects:
    models: dict[str, Wrapped] = field(default_factory=dict)
    optimizers: dict[str, torch.optim.Optimizer] = field(default_factory=dict)
    schedulers: dict[str, Any] = field(default_factory=dict)
    scalers: dict[str, torch.amp.GradScaler] = field(default_factory=dict)
    """hpctrain's GradScaler of each optimizer, by the optimizer's name (enabled under fp16 only)."""
    others: dict[str, Any] = field(default_factory=dict)
    """Any other object with state_dict and load_state_dict (a counter, a stateful data loader, a GradScaler of
    the user's own): rank 0's state is saved, every rank loads it."""
    pending: dict[int, Wrapped] = field(default_factory=dict)
    """Models wrapped but not registered yet, by id of the wrapped module."""
    _container: nn.ModuleDict | None = None

    # -- registration ---------------------------------------------------------------------------------------------

    def add_wrapped(self, entry: Wrapped) -> None:
        self.pending[id(entry.wrapped)] = entry

    def known_module(self, module: nn.Module) -> bool:
        """Whether run.wrap made or took this module already."""
        entries = [*self.pending.values(), *self.models.values()]
        return any(module is e.raw or module is e.wrapped for e in entries) or isinstance(module, (DDP, FSDPModule))

    def register(self, name: str, obj: Any, scaler: torch.amp.GradScaler) -> None:
        """One object under ``name``; ``scaler``: the loss scaler a new optimizer gets."""
        if not name.isidentifier():
            raise misuse(f"run.register: '{name}' is not a name", "register objects as name=object (identifiers).")
        kind = self._kind(obj)
        if name in getattr(self, kind):
            raise misuse(f"run.register: '{name}' is registered already",
                         "give every registered object its own name.")
        if isinstance(obj, nn.Module):
            self.models[name] = self._wrapped_entry(name, obj)
        elif isinstance(obj, torch.optim.Optimizer):
            self.optimizers[name] = obj
            self.scalers[name] = scaler
        elif isinstance(obj, SCHEDULER_TYPES):
            self.schedulers[name] = obj
        elif all(callable(getattr(obj, a, None)) for a in ("state_dict", "load_state_dict")):
            self.others[name] = obj
        else:
            raise misuse(f"run.register: '{name}' ({type(obj).__name__}) has no state_dict and load_state_dict, so a "
                         "checkpoint cannot hold it", "register models, optimizers, schedulers and objects with "
                         "state_dict()/load_state_dict(); keep what needs no saving out of the registry.")
        self._container = None

    def _wrapped_entry(self, name: str, module: nn.Module) -> Wrapped:
        for key, entry in list(self.pending.items()):
            if module is entry.wrapped or module is entry.raw:
                del self.pending[key]
                return entry
        if any(module is e.wrapped or module is e.raw for e in self.models.values()):
            raise misuse(f"run.register: model '{name}' is registered already under another name",
                         "register each model once.")
        raise misuse(f"run.register: model '{name}' ({type(module).__name__}) was not made by run.wrap",
                     f"register what run.wrap returned: {name} = run.wrap({name}) first (it places the model on the "
                     "device and wraps it per dist.strategy, which checkpoints and gradient sync rely on).")

    @staticmethod
    def _kind(obj: Any) -> str:
        """Which of the registry's dicts an object goes into (a name is unique within one)."""
        if isinstance(obj, nn.Module):
            return "models"
        if isinstance(obj, torch.optim.Optimizer):
            return "optimizers"
        return "schedulers" if isinstance(obj, SCHEDULER_TYPES) else "others"

    def check(self) -> None:
        """Before the first step: every wrapped model registered, every optimizer over registered models'
        parameters, every scheduler of a registered optimizer."""
        if self.pending:
            kinds = ", ".join(type(e.raw).__name__ for e in self.pending.values())
            raise misuse(f"{len(self.pending)} model(s) wrapped by run.wrap but not registered ({kinds}): a checkpoint "
                         "would not hold them", "run.register(name=model) every wrapped model before run.steps.")
        owned = {id(p) for e in self.models.values() for p in e.raw.parameters()}
        for name, optimizer in self.optimizers.items():
            strangers = [p for g in optimizer.param_groups for p in g["params"] if id(p) not in owned]
            if strangers:
                raise misuse(
                    f"optimizer '{name}' steps {len(strangers)} parameter(s) of no registered model",
                    "build each optimizer after run.wrap from the wrapped model's parameters (under dist.strategy="
                    "fsdp they become shards), and register that model.")
        seen: dict[int, str] = {}
        for name, optimizer in self.optimizers.items():
            for p in (p for g in optimizer.param_groups for p in g["params"]):
                if seen.setdefault(id(p), name) != name:
                    raise misuse(f"optimizers '{seen[id(p)]}' and '{name}' both step one parameter",
                                 "put every parameter in one optimizer only.")
        ours = {id(o) for o in self.optimizers.values()}
        for name, scheduler in self.schedulers.items():
            if id(getattr(scheduler, "optimizer", None)) not in ours:
                raise misuse(f"scheduler '{name}' schedules an optimizer that is not registered",
                             "register its optimizer too (the one it was built on).")

    def unregistered_schedulers(self) -> list[tuple[str, str]]:
        """(scheduler class, optimizer name) of each live scheduler of a registered optimizer that is not
        registered itself: its position would be lost on a resume. Found through the garbage collector's referrers
        of the optimizers (a scheduler holds its optimizer as an attribute)."""
        import gc

        ours = {id(s) for s in self.schedulers.values()}
        by_id = {id(o): name for name, o in self.optimizers.items()}
        found = []
        referrers = gc.get_referrers(*self.optimizers.values()) if self.optimizers else []
        holders = [r for r in referrers if isinstance(r, dict)]  # an instance __dict__ (or the instance itself)
        for owner in [*referrers, *(gc.get_referrers(*holders) if holders else ())]:
            if isinstance(owner, SCHEDULER_TYPES) and id(owner) not in ours and id(owner.optimizer) in by_id:
                found.append((type(owner).__name__, by_id[id(owner.optimizer)]))
        return sorted(set(found))

    # -- what a checkpoint and the loop see -------------------------------------------------------------------------

    def container(self) -> nn.ModuleDict:
        """The registered models' own modules in one ModuleDict: checkpoints name each parameter
        ``<model>.<parameter>``."""
        if self._container is None:
            self._container = nn.ModuleDict({name: e.raw for name, e in self.models.items()})
        return self._container

    def emas(self) -> dict[str, Any]:
        return {name: e.ema for name, e in self.models.items() if e.ema is not None}

    def stateful(self, experiment: Any = None) -> dict[str, Any]:
        """The named form checkpoint/state_dicts.py saves and loads."""
        return {"model": self.container(), "optimizers": self.optimizers, "schedulers": self.schedulers,
                "scalers": self.scalers, "emas": self.emas(),
                "ema_models": {name: e.raw for name, e in self.models.items() if e.ema is not None},
                "objects": self.others, "experiment": experiment}

    def shipped(self) -> nn.ModuleDict:
        """The weights a run validates, samples from and ships: each model's EMA copy where it has one."""
        return nn.ModuleDict({name: e.ema.module if e.ema is not None else e.raw for name, e in self.models.items()})

    def optimizer_models(self, name: str) -> list[str]:
        """The registered models with a parameter that optimizer ``name`` steps."""
        params = {id(p) for g in self.optimizers[name].param_groups for p in g["params"]}
        return [m for m, e in self.models.items() if any(id(p) in params for p in e.raw.parameters())]

    def schedulers_of(self, name: str) -> list[Any]:
        optimizer = self.optimizers[name]
        return [s for s in self.schedulers.values() if getattr(s, "optimizer", None) is optimizer]

    def optimizer_params(self, name: str) -> list[torch.Tensor]:
        return [p for g in self.optimizers[name].param_groups for p in g["params"]]
