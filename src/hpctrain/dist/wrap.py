"""Model placement and wrapping: device, memory format, DDP, then compile."""

from __future__ import annotations

import logging

import torch
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as DDP

from hpctrain.config.schema import RunConfig
from hpctrain.dist.runtime import Runtime
from hpctrain.errors import UserError, on_every_rank

log = logging.getLogger("hpctrain")


def wrap_model(model: nn.Module, cfg: RunConfig, runtime: Runtime) -> nn.Module:
    """The model to train with. Move before wrapping: DDP registers its hooks on the
    parameters it finds, and they must already live on the rank's device."""
    if use_sync_batchnorm(model, cfg.train.sync_batchnorm, runtime):
        # Before DDP (which must see the final modules); same parameters and buffers, so checkpoints load either way.
        model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
        if cfg.train.compile and runtime.is_main:
            log.warning("train.compile with SyncBatchNorm: torch.compile breaks its graph at every SyncBatchNorm "
                        "(a collective in the forward), so little is compiled; measure both, or set "
                        "train.sync_batchnorm=off (per-GPU statistics) to compile the whole model")
    model = model.to(runtime.device)
    if cfg.train.channels_last:
        model = model.to(memory_format=torch.channels_last)
    if runtime.distributed:
        model = _ddp(model, cfg, runtime)
    if cfg.train.compile:
        # Compile the DDP module, not the other way round (torch's documented order): dynamo's DDPOptimizer then
        # splits the graph at DDP's bucket boundaries, so each bucket's all-reduce starts while the backward of
        # the earlier layers still runs. A compiled module inside DDP runs its whole backward as one graph, and
        # every bucket fires only after it: no overlap of communication and compute.
        # A graph that fails to compile (a missing C compiler or Triton, an unsupported op) runs eagerly with a
        # logged warning instead of ending the run: dynamo's own fallback, per frame.
        torch._dynamo.config.suppress_errors = True
        model = torch.compile(model)  # type: ignore[assignment]
    return model


def use_sync_batchnorm(model: nn.Module, mode: str, runtime: Runtime) -> bool:
    """Whether to convert the model's batch norms (see train.sync_batchnorm)."""
    has_bn = any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in model.modules())
    if mode == "off" or not has_bn or not runtime.distributed:
        return False
    if runtime.device.type != "cuda":
        if mode == "on":
            raise on_every_rank(UserError(
                "train.sync_batchnorm=on, but torch's SyncBatchNorm runs only on GPUs and this run is on the CPU",
                "set train.sync_batchnorm=auto (per-process statistics on CPUs, synchronised on GPUs) or off."))
        return False
    return True


def _ddp(model: nn.Module, cfg: RunConfig, runtime: Runtime) -> DDP:
    ddp = DDP(
        model,
        device_ids=[runtime.device.index] if runtime.device.type == "cuda" else None,
        bucket_cap_mb=cfg.dist.bucket_cap_mb,
        find_unused_parameters=cfg.dist.find_unused_parameters,
        # Gradients are written straight into the buckets: one copy less per step.
        gradient_as_bucket_view=True,
    )
    if cfg.dist.grad_compression != "none":
        hook = {"bf16": default_hooks.bf16_compress_hook, "fp16": default_hooks.fp16_compress_hook}
        ddp.register_comm_hook(None, hook[cfg.dist.grad_compression])  # state None: the default process group
    return ddp


def ddp_of(model: nn.Module) -> DDP | None:
    """The DDP module of a wrapped model (under torch.compile too), or None for one process: its no_sync()
    keeps gradients local during accumulation."""
    model = getattr(model, "_orig_mod", model)
    return model if isinstance(model, DDP) else None


def unwrap_model(model: nn.Module) -> nn.Module:
    """The plain module under torch.compile and DDP: what checkpoints and evaluation use."""
    model = getattr(model, "_orig_mod", model)
    if isinstance(model, DDP):
        model = model.module
    return getattr(model, "_orig_mod", model)  # a model compiled inside DDP (not hpctrain's order; a user's)
