"""What a checkpoint holds, by name, whatever the strategy: torch.distributed.checkpoint's state_dict helpers.

``get_state_dict`` names every tensor by its parameter's fully qualified name, with DDP's ``module.``, FSDP's
and torch.compile's wrappers taken off, and the optimizer state flattened to ``state.<name>.<key>`` and
``param_groups.<name>.<key>``: a checkpoint written under ddp, zero1 or fsdp by W processes is the same set of
names, and DCP reshards each tensor to whatever the loading ranks hold (a full tensor, or a DTensor shard).

Under zero1 each rank's optimizer holds the state of its partition only: the inner optimizer's state dict then
names just those parameters, every rank writes its own, and together they are the whole state (DCP keeps the one
copy of each name). ZeroRedundancyOptimizer.state_dict() itself would first gather everything on one rank.

Only tensors (and the optimizer's per-parameter hyperparameters, which it flattens) go through DCP. The small rest (scheduler, loss scaler, EMA count, the experiment's state) is the
same on every rank; rank 0 writes it with torch.save (train.pt), and a resume reads it once and broadcasts it.
"""

from __future__ import annotations

from typing import Any, Iterable, Mapping

import torch
from torch import nn
from torch.distributed.checkpoint._traverse import set_element  # what DefaultLoadPlanner.load_bytes uses
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)
from torch.distributed.optim import ZeroRedundancyOptimizer

from hpctrain.dist.wrap import unwrap_model

OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)
"""Flattened optimizer state: each entry is named by its parameter, so a zero1 rank's partition, a DDP rank's
whole state and an FSDP rank's shards are all subsets of one set of names."""

REPLICATED = {"ddp": frozenset({"model", "optim", "ema"}), "zero1": frozenset({"model", "ema"}), "fsdp": frozenset()}
"""The parts of tensor_state() that every rank holds whole, per dist.strategy: a resume reads them once (rank 0)
and broadcasts them; the others each rank reads its own part of."""

TRAIN_FILE = "train.pt"
DCP_DIR = "dcp"


def local_optimizer(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """The optimizer whose state this rank holds: ZeRO's inner one (its partition), or the optimizer itself."""
    return optimizer.optim if isinstance(optimizer, ZeroRedundancyOptimizer) else optimizer


def optimizers_of(stateful: Mapping[str, Any]) -> list[torch.optim.Optimizer]:
    """The run's optimizers: one (an Experiment's, under the key ``optimizer``) or several by name (``optimizers``:
    a StepExperiment's, a session's), in a fixed order."""
    if "optimizers" in stateful:
        return list(stateful["optimizers"].values())
    return [stateful["optimizer"]] if stateful.get("optimizer") is not None else []


def ema_container(stateful: Mapping[str, Any]) -> nn.Module | None:
    """The module whose state is the checkpoint's ``ema`` part: an Experiment's one EMA copy, or the EMA copies of
    several models by name (an nn.ModuleDict, so each is named ``ema.<name>.<parameter>``); None without EMA."""
    if "emas" in stateful:
        emas = stateful["emas"]
        return nn.ModuleDict({name: ema.module for name, ema in emas.items()}) if emas else None
    ema = stateful.get("ema")
    return ema.module if ema is not None else None


def has_ema(stateful: Mapping[str, Any]) -> bool:
    return bool(stateful.get("emas")) or stateful.get("ema") is not None


def without_ema(stateful: Mapping[str, Any]) -> dict[str, Any]:
    """The same run's state without its EMA copies (a resume whose checkpoint holds none starts them afresh)."""
    return {**stateful, "ema": None, "emas": {}} if "emas" in stateful else {**stateful, "ema": None}


def tensor_state(stateful: Mapping[str, Any]) -> dict[str, Any]:
    """The DCP state dict of a training run: model, optimizer and EMA tensors (EMA only when there is one).

    ``model`` is one module or an nn.ModuleDict of several (each named by its key); the optimizers' state is named
    by parameter across all of them (each parameter belongs to one optimizer). Collective-free under every strategy
    (FSDP2's sharded state dict is local); it initialises an optimizer's state with a zero step when empty (a fresh
    optimizer used as the template of a load), as torch's helper does."""
    optimizers = optimizers_of(stateful)
    for optimizer in optimizers:
        if isinstance(optimizer, ZeroRedundancyOptimizer):
            _copy_hyperparameters(optimizer.param_groups, optimizer.optim.param_groups)
    model_sd, optim_sd = get_state_dict(stateful["model"], tuple(local_optimizer(o) for o in optimizers),
                                        options=OPTIONS)
    state = {"model": model_sd, "optim": optim_sd}
    ema = ema_container(stateful)
    if ema is not None:
        state["ema"] = get_model_state_dict(ema)
    return state


def small_state(stateful: Mapping[str, Any]) -> dict[str, Any]:
    """What rank 0 writes to train.pt: the same on every rank, small, loadable with weights_only. An Experiment's
    run: its scheduler and scaler; several optimizers: each one's scheduler and scaler by name, and the other
    registered objects' state (``objects``)."""
    if "optimizers" in stateful:
        state: dict[str, Any] = {
            "schedulers": {name: s.state_dict() for name, s in stateful["schedulers"].items()},
            "scalers": {name: s.state_dict() for name, s in stateful["scalers"].items()},
            "objects": {name: o.state_dict() for name, o in stateful.get("objects", {}).items()},
            "ema_n_averaged": {name: int(e.n_averaged) for name, e in stateful.get("emas", {}).items()},
        }
    else:
        state = {"scheduler": stateful["scheduler"].state_dict(), "scaler": stateful["scaler"].state_dict()}
        if stateful.get("ema") is not None:
            state["ema_n_averaged"] = int(stateful["ema"].n_averaged)
    if stateful.get("experiment") is not None:
        state["experiment"] = stateful["experiment"].state_dict()
    return state


def saved_optimizer_params(checkpoint_names: Iterable[str]) -> tuple[set[str], set[str]]:
    """(every parameter of the saved optimizer, those it holds state for), by name, from the names in a
    checkpoint's DCP metadata: ``optim.param_groups.<param>.<key>`` for each parameter, ``optim.state.<param>.<key>``
    for its state (a key such as lr or exp_avg has no dot, a parameter's name may)."""
    found: dict[str, set[str]] = {"optim.param_groups.": set(), "optim.state.": set()}
    for name in checkpoint_names:
        for prefix, names in found.items():
            if name.startswith(prefix):
                names.add(name[len(prefix):name.rindex(".")])
    return found["optim.param_groups."], found["optim.state."]


def drop_unsaved_optimizer_state(stateful: Mapping[str, Any], template: dict[str, Any], saved: set[str]) -> None:
    """Take out of a load template, and out of the live optimizer, the state of parameters the checkpoint has none
    for: a trainable parameter that never got a gradient (a head the loss does not use) never had optimizer
    state, but the template's zero step (torch's _init_optim_state) gives every parameter some, and the load then
    fails on a missing name. Without state the resumed optimizer treats the parameter as the uninterrupted run
    does: fresh, should it ever get a gradient. Only parameters with no saved state at all are dropped; one with
    some of its keys missing (another optimizer) is still a mismatch that the load reports."""
    optim = template.get("optim", {})
    keys_by_param: dict[str, list[str]] = {}
    for key in optim:
        if key.startswith("state."):
            keys_by_param.setdefault(key[len("state."):key.rindex(".")], []).append(key)
    dropped = [name for name in keys_by_param if name not in saved]
    if not dropped:
        return
    inners = [local_optimizer(o) for o in optimizers_of(stateful)]
    params = _params_by_name(stateful["model"])
    for name in dropped:
        for key in keys_by_param[name]:
            optim.pop(key)
        for inner in inners:
            if name in params and params[name] in inner.state:
                # Emptied, not removed: an optimizer whose state is empty altogether (a zero1 rank whose partition
                # is only such parameters) would get torch's zero step again inside set_state_dict.
                inner.state[params[name]] = {}


def _params_by_name(model: nn.Module) -> dict[str, nn.Parameter]:
    """Parameters by the names get_state_dict gives them: without DDP's, torch.compile's and activation
    checkpointing's wrapper names (FSDP2 adds none)."""
    plain = unwrap_model(model)
    return {".".join(p for p in name.split(".") if p != "_checkpoint_wrapped_module"): param
            for name, param in plain.named_parameters()}


def apply_tensor_state(stateful: Mapping[str, Any], loaded: Mapping[str, Any]) -> None:
    """Put a loaded tensor_state() into the live objects (the template's tensors were filled in place by DCP; this
    copies them into parameters and optimizer state where the helpers need to, e.g. the optimizer's step counts)."""
    optimizers = optimizers_of(stateful)
    inners = [local_optimizer(o) for o in optimizers]
    # torch's set_state_dict fails (IndexError) on a parameter group without parameters, which ZeRO's partition
    # gives some ranks: load the groups that have parameters, then put the empty ones back in their places.
    groups = [inner.param_groups for inner in inners]
    for inner in inners:
        inner.param_groups = [g for g in inner.param_groups if g["params"]]
    try:
        set_state_dict(stateful["model"], tuple(inners), model_state_dict=loaded["model"],
                       optim_state_dict=loaded["optim"], options=OPTIONS)
    finally:
        for inner, original in zip(inners, groups):
            filled = iter(inner.param_groups)
            inner.param_groups = [next(filled) if g["params"] else g for g in original]
    for optimizer in optimizers:
        if isinstance(optimizer, ZeroRedundancyOptimizer):
            _sync_outer_groups(optimizer)
    if "ema" in loaded:
        set_model_state_dict(ema_container(stateful), loaded["ema"])


def _sync_outer_groups(zero: ZeroRedundancyOptimizer) -> None:
    """ZeRO copies its own param_groups' hyperparameters into the inner optimizer at every step; after loading the
    inner one, the outer groups must say the same (the learning rate of the resumed step, among others)."""
    _copy_hyperparameters(zero.optim.param_groups, zero.param_groups, skip_empty=True)


def _copy_hyperparameters(source: list[dict[str, Any]], target: list[dict[str, Any]], skip_empty: bool = False) -> None:
    """ZeRO keeps the scheduled hyperparameters (lr) in its outer groups and copies them into the inner optimizer
    only when it steps: after a step and its scheduler step the inner groups hold the last step's lr. A save copies
    them first (or the checkpoint would resume one step behind on the schedule), a load copies them back out."""
    for src, dst in zip(source, target, strict=True):
        if src["params"] or not skip_empty:  # an empty inner group loaded nothing: its values are not the run's
            dst.update({k: v for k, v in src.items() if k != "params"})


def model_weights(model: nn.Module) -> dict[str, torch.Tensor]:
    """The template to load one model's weights into (eval, sample, predict, export): its state dict by name."""
    return get_model_state_dict(model)


def set_model_weights(model: nn.Module, weights: Mapping[str, torch.Tensor]) -> None:
    set_model_state_dict(model, dict(weights))


def save_planner() -> DefaultSavePlanner:
    """DCP's planner, with each replicated tensor written by the lowest rank that holds it, i.e. rank 0's copy.
    Replicated is not always equal: under ddp (and for FSDP's unsharded buffers) each rank's batch-norm statistics
    are those of its own batches, and DCP's default spreads the writes over the ranks, so a checkpoint held a mix
    of ranks' statistics. Rank 0's are the ones validation uses and a checkpoint has always held."""
    return DefaultSavePlanner(dedup_save_to_lowest_rank=True)


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's load planner, but non-tensor entries are unpickled with weights_only=True (DCP's own uses
    weights_only=False): a checkpoint cannot run code when it is loaded, as for every file hpctrain reads."""

    def load_bytes(self, read_item, value) -> None:  # type: ignore[override]
        obj = torch.load(value, weights_only=True)
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
        else:
            self.state_dict[read_item.dest_index.fqn] = obj
