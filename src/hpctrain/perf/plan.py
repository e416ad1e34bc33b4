"""Scaling estimates: the step time of N x G data-parallel ranks from one device's measured step.

Pure arithmetic; the measurement is in step_profile. The model (every assumption is printed with
the estimate):

- weak scaling: each rank runs the same micro batch as the measured device, so compute per step
  does not change with the number of ranks;
- DDP all-reduces gradients in buckets of dist.bucket_cap_mb, one bucket after another, each as
  soon as the backward pass has produced it; gradients are assumed to appear at an even rate over
  the backward of the last micro-batch (accumulation micro-steps communicate nothing);
- one bucket's all-reduce takes bytes x 2(n-1)/n / busbw (the ring's traffic; busbw as nccl-tests
  and `hpctrain doctor --perf` define it); per-message latency is not modelled, so very small
  models are estimated optimistically;
- bf16 gradient compression halves the bytes on the wire and is otherwise free.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace


@dataclass(frozen=True)
class StepProfile:
    """One micro-batch on one device, measured."""

    forward_s: float
    """Forward pass and loss."""
    backward_s: float
    """Backward pass."""
    optimizer_s: float
    """Optimizer step (with clipping, scheduler and EMA), once per optimizer step."""
    grad_bytes: int
    """Bytes of gradient all-reduced per optimizer step (trainable parameters x element size)."""
    micro_batch: int
    """Samples in the measured micro-batch."""


@dataclass(frozen=True)
class ClusterShape:
    nodes: int
    gpus_per_node: int
    """Ranks per node."""
    grad_accum: int = 1
    """Micro-batches per optimizer step on each rank."""
    bucket_bytes: int = 25 * 2**20
    """DDP bucket size (dist.bucket_cap_mb)."""
    compression: str = "none"
    """'none', or 'bf16'/'fp16': gradients cast to 16 bits for the all-reduce (DDP comm hook)."""

    @property
    def world_size(self) -> int:
        return self.nodes * self.gpus_per_node


@dataclass(frozen=True)
class Estimate:
    layout: ClusterShape
    compute_s: float
    """Forward + backward of every micro-batch, and the optimizer step."""
    comm_s: float
    """All-reduce time of all buckets, were nothing overlapped."""
    exposed_comm_s: float
    """Communication not hidden behind the backward pass: what it adds to the step."""
    step_s: float
    efficiency: float
    """One device's step time (same work per rank) over this step time."""
    samples_per_s: float


def allreduce_seconds(nbytes: float, world_size: int, busbw_gbps: float) -> float:
    """Ring all-reduce time of one message: bytes x 2(n-1)/n over the bus bandwidth."""
    if world_size <= 1 or nbytes <= 0:
        return 0.0
    return nbytes * 2 * (world_size - 1) / world_size / (busbw_gbps * 1e9)


def bucket_sizes(grad_bytes: int, bucket_bytes: int) -> list[int]:
    full, rest = divmod(grad_bytes, bucket_bytes)
    return [bucket_bytes] * full + ([rest] if rest else [])


def exposed_communication(backward_s: float, sizes: list[int], seconds_per_byte: float) -> float:
    """Buckets start when ready (gradients at an even rate over backward_s) and run one at a time;
    returns how far the last one ends after the backward pass."""
    total = sum(sizes)
    done = produced = 0.0
    for size in sizes:
        produced += size
        ready = backward_s * produced / total
        done = max(done, ready) + size * seconds_per_byte
    return max(done - backward_s, 0.0)


def estimate(profile: StepProfile, layout: ClusterShape, busbw_gbps: float) -> Estimate:
    n = layout.world_size
    compute = layout.grad_accum * (profile.forward_s + profile.backward_s) + profile.optimizer_s
    wire = 0.5 if layout.compression in ("bf16", "fp16") else 1.0
    sizes = bucket_sizes(profile.grad_bytes, layout.bucket_bytes)
    per_byte = allreduce_seconds(wire, n, busbw_gbps)  # seconds per gradient byte
    comm = profile.grad_bytes * per_byte
    exposed = exposed_communication(profile.backward_s, sizes, per_byte) if n > 1 else 0.0
    step = compute + exposed
    samples = n * layout.grad_accum * profile.micro_batch
    return Estimate(layout, compute, comm, exposed, step, compute / step, samples / step)


@dataclass(frozen=True)
class Advice:
    bound: bool
    """Communication adds more than `limit` of the step (efficiency below 1 - limit)."""
    alternatives: list[Estimate]
    """bf16 compression, and gradient accumulation up to the first factor that reaches the target."""
    lines: list[str]


def advise(profile: StepProfile, layout: ClusterShape, busbw_gbps: float, target: float = 0.9) -> Advice:
    base = estimate(profile, layout, busbw_gbps)
    if layout.world_size == 1 or base.efficiency >= target:
        return Advice(False, [], [])
    alternatives, lines = [], [
        f"communication-bound: {base.exposed_comm_s * 1e3:.1f} ms of each {base.step_s * 1e3:.1f} ms step is "
        f"all-reduce the backward pass cannot hide (efficiency {base.efficiency:.0%}, target {target:.0%})."
    ]
    if layout.compression == "none":
        squeezed = estimate(profile, replace(layout, compression="bf16"), busbw_gbps)
        alternatives.append(squeezed)
        lines.append(f"dist.grad_compression=bf16 (DDP's bf16_compress_hook) halves the bytes: efficiency "
                     f"{squeezed.efficiency:.0%}.")
    for factor in (2, 4, 8, 16, 32):
        accum = layout.grad_accum * factor
        longer = estimate(profile, replace(layout, grad_accum=accum), busbw_gbps)
        alternatives.append(longer)
        if longer.efficiency >= target:
            lines.append(
                f"{accum} micro-batches per step (train.global_batch_size x{factor}, or gradient accumulation) reach "
                f"{longer.efficiency:.0%}; a {factor}x larger micro batch does about the same if memory allows "
                "(compute assumed linear in the batch), with fewer passes."
            )
            break
    else:
        lines.append("even 32x more work per step stays below the target: the network is too slow for this model; "
                     "fewer nodes, or sharded training that overlaps more, would be needed.")
    return Advice(True, alternatives, lines)


def nearest_row(rows: list[dict], nbytes: int) -> dict:
    """The bandwidth measurement whose message size is closest (in log scale) to a bucket's."""
    return min(rows, key=lambda r: abs(math.log(r["bytes"]) - math.log(max(nbytes, 1))))
