"""Model placement and wrapping: device, memory format, then DDP (ddp, zero1) or FSDP2 (fsdp), then compile."""

from __future__ import annotations

import contextlib
import logging

import torch
from torch import nn
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel as DDP

from hpctrain.config.schema import RunConfig
from hpctrain.dist.runtime import Runtime
from hpctrain.errors import UserError, on_every_rank

log = logging.getLogger("hpctrain")


def place_model(model: nn.Module, cfg: RunConfig, runtime: Runtime) -> nn.Module:
    """The model on the rank's device, in its memory format, with synchronised batch norms where configured: what
    every strategy starts from (and what an EMA copy is made of)."""
    # Not under fsdp (refused with 'on' by the config; 'auto' keeps per-rank statistics there).
    if cfg.dist.strategy != "fsdp" and use_sync_batchnorm(model, cfg.train.sync_batchnorm, runtime):
        # Before DDP (which must see the final modules); same parameters and buffers, so checkpoints load either way.
        model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
        if cfg.train.compiled and runtime.is_main:
            log.warning("train.compile with SyncBatchNorm: torch.compile breaks its graph at every SyncBatchNorm "
                        "(a collective in the forward), so little is compiled; measure both, or set "
                        "train.sync_batchnorm=off (per-GPU statistics) to compile the whole model")
    model = model.to(runtime.device)
    if cfg.train.channels_last_on and not (cfg.dist.strategy == "fsdp" and runtime.distributed):
        model = model.to(memory_format=torch.channels_last)
    # Under fsdp the parameters stay contiguous: FSDP2 shards only contiguous parameters (torch 2.14 raises
    # NotImplementedError on channels_last weights). The batches are still channels_last (train/device.py), and a
    # convolution with a channels_last input runs channels_last.
    return model


def wrap_model(model: nn.Module, cfg: RunConfig, runtime: Runtime, blocks: list[nn.Module] | None = None,
               companions: tuple[nn.Module, ...] = (), param_dtype: torch.dtype | None = None) -> nn.Module:
    """The model to train with: placed (place_model; a placed model stays as it is), then wrapped. Placed first:
    DDP registers its hooks on the parameters it finds, and FSDP shards them where they are.

    Under fsdp, ``blocks`` are the modules sharded one by one (Experiment.fsdp_blocks); ``companions`` are copies
    of the model (the EMA weights) sharded the same way; ``param_dtype`` (bf16 on GPUs) is the dtype parameters
    are gathered and computed in. One process: no wrapper under any strategy (nothing to shard or reduce; a
    checkpoint names tensors the same either way)."""
    model = place_model(model, cfg, runtime)
    if runtime.distributed:
        if cfg.dist.strategy == "fsdp":
            model = shard_model(model, cfg, runtime, blocks or [], companions, param_dtype)
        else:
            model = _ddp(model, cfg, runtime)
    if cfg.train.compiled:
        # Compile the DDP module, not the other way round (torch's documented order): dynamo's DDPOptimizer then
        # splits the graph at DDP's bucket boundaries, so each bucket's all-reduce starts while the backward of
        # the earlier layers still runs. A compiled module inside DDP runs its whole backward as one graph, and
        # every bucket fires only after it: no overlap of communication and compute. (fsdp with compile is refused
        # by the config: whole-model compile of FSDP2 fails in torch 2.14's inductor.)
        # A graph that fails to compile (a missing C compiler or Triton, an unsupported op) runs eagerly with a
        # logged warning instead of ending the run: dynamo's own fallback, per frame.
        torch._dynamo.config.suppress_errors = True
        model = torch.compile(model)  # type: ignore[assignment]
    return model


def shard_model(model: nn.Module, cfg: RunConfig, runtime: Runtime, blocks: list[nn.Module],
                companions: tuple[nn.Module, ...] = (), param_dtype: torch.dtype | None = None) -> nn.Module:
    """FSDP2: fully_shard on each block, then on the root (which takes the parameters outside every block, so
    that every parameter is a DTensor: clip_grad_norm_ needs that). Rank 0's weights first go to every rank, as
    DDP's constructor does: weights loaded on rank 0 alone (Experiment.init_weights) would otherwise be sharded
    from each rank's own copy."""
    broadcast_module(model, runtime)
    names = {id(m): name for name, m in model.named_modules()}
    unknown = [b for b in blocks if id(b) not in names or b is model]
    if unknown:
        raise on_every_rank(UserError(
            f"Experiment.fsdp_blocks returned {len(unknown)} module(s) that are not submodules of the model "
            f"(e.g. {type(unknown[0]).__name__})", "return submodules of the model passed to fsdp_blocks."))
    options = dict(
        reshard_after_forward=cfg.dist.fsdp_reshard_after_forward,
        mp_policy=MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32 if param_dtype else None),
        # Pinned host memory needs CUDA (the default, pin_memory=True, fails without it).
        offload_policy=CPUOffloadPolicy(pin_memory=runtime.device.type == "cuda") if cfg.dist.fsdp_cpu_offload
        else OffloadPolicy(),
    )
    for target in (model, *companions):
        for name in [names[id(b)] for b in blocks]:
            fully_shard(target.get_submodule(name), **options)
        fully_shard(target, **options)
    return model


def broadcast_module(model: nn.Module, runtime: Runtime) -> None:
    """Rank 0's parameters and buffers to every rank, in buckets (what DDP's constructor does)."""
    tensors = [t.detach() for t in (*model.parameters(), *model.buffers())]
    by_device: dict[torch.device, list[torch.Tensor]] = {}
    for t in tensors:
        by_device.setdefault(t.device, []).append(t)
    for group in by_device.values():
        dist._broadcast_coalesced(dist.group.WORLD, group, 250 << 20, 0)


def use_sync_batchnorm(model: nn.Module, mode: str, runtime: Runtime) -> bool:
    """Whether to convert the model's batch norms (see train.sync_batchnorm)."""
    # Already converted models (place_model ran) have nothing left to convert.
    has_bn = any(isinstance(m, nn.modules.batchnorm._BatchNorm) and not isinstance(m, nn.SyncBatchNorm)
                 for m in model.modules())
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
    cuda = runtime.device.type == "cuda"
    # A step captured as a CUDA graph (train.step_mode=graphed) needs DDP built on a side stream (torch's notes on
    # whole-network capture): its reducer's gradient hooks keep the stream current at construction.
    side = torch.cuda.Stream(runtime.device) if cuda and cfg.train.step_mode == "graphed" else None
    if side is not None:
        side.wait_stream(torch.cuda.current_stream(runtime.device))
    with torch.cuda.stream(side) if side is not None else contextlib.nullcontext():
        ddp = DDP(
            model,
            device_ids=[runtime.device.index] if cuda else None,
            bucket_cap_mb=cfg.dist.bucket_cap_mb,
            find_unused_parameters=cfg.dist.find_unused_parameters,
            # Gradients are written straight into the buckets: one copy less per step.
            gradient_as_bucket_view=True,
        )
    if side is not None:
        torch.cuda.current_stream(runtime.device).wait_stream(side)
    if cfg.dist.grad_compression != "none":
        hook = {"bf16": default_hooks.bf16_compress_hook, "fp16": default_hooks.fp16_compress_hook}
        ddp.register_comm_hook(None, hook[cfg.dist.grad_compression])  # state None: the default process group
    return ddp


def fsdp_of(model: nn.Module) -> FSDPModule | None:
    """The FSDP2 root of a wrapped model (under torch.compile too), or None."""
    model = getattr(model, "_orig_mod", model)
    return model if isinstance(model, FSDPModule) else None


def reshard(model: nn.Module) -> None:
    """Put every FSDP2 module of ``model`` back in its sharded state. With dist.fsdp_reshard_after_forward=false,
    FSDP2 keeps a module's parameters gathered after its forward until the backward reshards them; a forward
    without a backward (validation, the EMA weights') leaves them gathered, registered as plain full tensors, and
    what reads the parameters next (the EMA update's per-shard lerp, a checkpoint's sharded state dict) sees whole
    tensors where it expects this rank's shards. A no-op for sharded modules and for models without FSDP."""
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


def full_value(tensor: torch.Tensor | None) -> torch.Tensor | None:
    """A plain tensor of a possibly distributed one (clip_grad_norm_ returns a DTensor under fsdp; its full_tensor
    is a collective, which every rank runs at the same point)."""
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def ddp_of(model: nn.Module) -> DDP | None:
    """The DDP module of a wrapped model (under torch.compile too), or None for one process: its no_sync()
    keeps gradients local during accumulation."""
    model = getattr(model, "_orig_mod", model)
    return model if isinstance(model, DDP) else None


def unwrap_model(model: nn.Module) -> nn.Module:
    """The module whose parameters are trained, under torch.compile and DDP: what checkpoints, clipping, EMA and
    evaluation use. Under fsdp that is the sharded module itself (FSDP2 wraps in place; its parameters are
    DTensors)."""
    model = getattr(model, "_orig_mod", model)
    if isinstance(model, DDP):
        model = model.module
    return getattr(model, "_orig_mod", model)  # a model compiled inside DDP (not hpctrain's order; a user's)
