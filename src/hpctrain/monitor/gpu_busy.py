"""How busy each rank's GPU was over a log window, and what to try when the host, not the GPU, set the pace.

The number is NVML's GPU utilisation: the driver samples whether a kernel was running (one sample per 1/6 to 1 s,
depending on the product) and nvmlDeviceGetSamples hands back the samples taken since a time stamp; the mean of a
window's samples is the fraction of it the GPU ran kernels. CUDA events, the other candidate, cannot show this: an
event pair times the span of a step on the GPU, gaps included, and in a host-bound step the gaps (the GPU waiting
for the host's next launch) are what is to be seen. Only NVML and a profiler (CUPTI) see kernel time, and a profiler
costs far more than one NVML call per log line.

NVML's caveats, said where the number is shown: it counts the whole GPU (another process on it counts too); a
kernel counts as busy however few of the GPU's units it uses, so 100% is not efficiency and a low number is the
conclusive one; MIG instances have no utilisation samples (then nothing is shown). The samples are asked for with the
newest time stamp already seen, not a clock of ours: NVML's time stamps need not be on any clock Python reads.

The bindings are NVIDIA's own (nvidia-ml-py, imported as pynvml), loaded only on CUDA runs.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # `hpctrain report` imports this module: it must not pay for torch's import
    import torch

HOST_BOUND = 0.80
"""A window whose GPU ran kernels less than this fraction of the time, without waiting for the loader, was set by
the host (launching kernels, Python, autograd). A rule of thumb: issue 26's profile of the eager DDPM step on one H100
at batch 128 found ~48 ms of kernels in a ~65-68 ms step (about 70%; less at the reference micro batch 64, whose step
takes as long); a step bound by the GPU leaves it idle only between steps."""
LOADER_BOUND = 0.25
"""Ranks wait this fraction of a window for batches: the loader, not the model, sets the pace."""
SILENT_WINDOWS = 3
"""Log windows without any sample, from the start, before the log says NVML gives none here."""
MIN_SAMPLES = 2
"""Fewer samples in a window (a window shorter than about two sampling periods) give no number. NVML keeps about a
hundred samples: a window longer than that many sampling periods (~16 s at 1/6 s) is measured by its last part."""

# nvmlValueType_t -> the member of nvmlValue_t holding the sample (utilisation samples are unsigned ints).
_VALUE_FIELDS = {0: "dVal", 1: "uiVal", 2: "ulVal", 3: "ullVal", 4: "sllVal", 5: "siVal", 6: "usVal"}


class NvmlBusy:
    """One GPU's utilisation samples, read window by window."""

    def __init__(self, nvml: Any, handle: Any) -> None:
        self.nvml = nvml
        """The pynvml module (a stand-in in the tests)."""
        self.handle = handle
        self.last_seen = 0
        """NVML's time stamp of the newest sample read: the next window's samples are the ones after it."""
        self.empty_reads = 0
        """Consecutive windows without a sample (none at all since the start: said once, see silent())."""
        self.ever = False
        """Some window has had a sample."""

    def mark(self) -> None:
        """A window starts now: the samples so far are not its own."""
        self._samples()

    def read(self) -> float | None:
        """The fraction (0-1) of the time since the last mark() or read() the GPU ran kernels; None when too few
        samples were taken in it (or NVML failed, which is not worth a training run)."""
        values = self._samples()
        self.ever |= bool(values)
        self.empty_reads = 0 if values else self.empty_reads + 1
        return statistics.fmean(values) / 100.0 if len(values) >= MIN_SAMPLES else None

    def silent(self) -> bool:
        """True once, at the third window in a row without a single sample since the start: NVML gave a handle but
        keeps no samples for this GPU (reported of MIG instances); the log then says so instead of nothing."""
        return not self.ever and self.empty_reads == SILENT_WINDOWS

    def _samples(self) -> list[float]:
        try:
            kind, samples = self.nvml.nvmlDeviceGetSamples(self.handle, self.nvml.NVML_GPU_UTILIZATION_SAMPLES,
                                                           self.last_seen)
        except self.nvml.NVMLError:  # NVML_ERROR_NOT_FOUND: no sample since last_seen
            return []
        name = _VALUE_FIELDS.get(int(kind), "uiVal")
        fresh = [s for s in samples if s.timeStamp > self.last_seen]
        if fresh:
            self.last_seen = max(s.timeStamp for s in fresh)
        return [float(getattr(s.sampleValue, name)) for s in fresh]


@dataclass(frozen=True)
class BusyMeter:
    """What this rank measures: NvmlBusy, or None and why not (said once in the log)."""

    meter: NvmlBusy | None
    why_not: str = ""


def open_meter(device: "torch.device", nvml: Any = None) -> BusyMeter:
    """The meter for this rank's GPU, found by its UUID (NVML's own indices need not be CUDA's)."""
    if device.type != "cuda":
        return BusyMeter(None, "")
    if nvml is None:
        try:
            import pynvml as nvml
        except ImportError:
            return BusyMeter(None, "nvidia-ml-py is not installed (pip install nvidia-ml-py)")
    from hpctrain.dist.gpu_identity import device_identity

    try:
        nvml.nvmlInit()
        handle = nvml.nvmlDeviceGetHandleByUUID(device_identity(device))
    except nvml.NVMLError as err:  # no driver library, no permission; a MIG instance's UUID: NOT_FOUND here
        return BusyMeter(None, f"NVML has no handle for this GPU ({err}; MIG instances have no utilisation samples)")
    try:
        nvml.nvmlDeviceGetSamples(handle, nvml.NVML_GPU_UTILIZATION_SAMPLES, 0)
    except nvml.NVMLError as err:
        # NOT_FOUND: no sample yet (an idle GPU's buffer can be empty): the windows will have them.
        if not isinstance(err, getattr(nvml, "NVMLError_NotFound", ())):
            return BusyMeter(None, f"NVML gives no utilisation samples here ({err})")
    return BusyMeter(NvmlBusy(nvml, handle))


def host_bound(busy: float | None, data_wait_frac: float) -> bool:
    """The GPU idled without waiting for the loader: the host's launching set the pace."""
    return busy is not None and busy < HOST_BOUND and data_wait_frac < LOADER_BOUND


@dataclass(frozen=True)
class StepFacts:
    """What a run does now, for host_bound_advice: only what it could change to is suggested."""

    mode: str
    """The step that runs: graphed (replaying a graph), compiled or eager."""
    capture_refusal: str
    """Why the step cannot be captured in this run ('' when it can: graph_refusal, or an auto fallback's reason)."""
    distributed: bool
    can_compile: bool
    """train.compile is allowed (not under dist.strategy=fsdp)."""
    grad_accum: int
    micro_batch: int
    on_device: bool = False
    """data.on_device: the batches are already cut on the GPU."""


def host_bound_advice(f: StepFacts) -> str:
    """What to try, from what the run does now."""
    lead, tips = "", []
    if f.mode == "graphed":
        lead = ("The step is already one CUDA graph replay: the host's work between replays (batch copies, the "
                "loader, logging) sets the pace. ")
        if not f.on_device:
            tips.append("keep the data on the GPU (data.on_device=true)")
    elif f.capture_refusal:
        lead = f"The step cannot be captured as a CUDA graph here ({f.capture_refusal}). "
    elif f.distributed:
        tips.append("train.step_mode=graphed captures the whole step, DDP's all-reduce included (opt-in: it has not "
                    "yet run on several GPUs)")
    else:
        tips.append("train.step_mode=auto (or graphed) captures the whole step as one CUDA graph")
    if f.mode == "eager" and f.can_compile:
        tips.append("train.compile=true fuses the model's kernels (fewer launches)")
    if f.grad_accum > 1:
        tips.append(f"a larger train.micro_batch_size (now {f.micro_batch}, with {f.grad_accum} accumulation steps: "
                    "fewer of them for the same global batch) gives each launch more work")
    else:
        tips.append(f"each launch does more work with a larger batch (micro batch {f.micro_batch}, no accumulation: "
                    "that means a larger train.global_batch_size, a change of the recipe)")
    return f"{lead}Try: {'; '.join(tips)}."
