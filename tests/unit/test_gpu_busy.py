"""GPU busy per log window (monitor/gpu_busy.py): NVML's samples read window by window, the host-bound warning in the
training log, and what `hpctrain report` makes of it. NVML itself needs a GPU: here a stand-in with pynvml's
interface (nvmlDeviceGetSamples returns (value type, samples with timeStamp and sampleValue)); tests/gpu has the
real one."""

from __future__ import annotations

import ctypes
import dataclasses
import json
import logging
import math
import sys
from types import SimpleNamespace

import pytest
import torch

from hpctrain.dist.runtime import single_process_runtime
from hpctrain.monitor import gpu_busy
from hpctrain.monitor.gpu_busy import HOST_BOUND, NvmlBusy, StepFacts, host_bound, host_bound_advice, open_meter
from hpctrain.monitor.report import observations, summary_facts, load_run, write_report
from hpctrain.train import loop


class _Value(ctypes.Union):
    _fields_ = [("dVal", ctypes.c_double), ("uiVal", ctypes.c_uint)]


class FakeNvml:
    """pynvml's calls that gpu_busy makes, over a list of (timestamp, percent) samples the test appends to."""

    NVML_GPU_UTILIZATION_SAMPLES = 1

    class NVMLError(Exception):
        pass

    class NVMLError_NotFound(NVMLError):  # noqa: N801 - pynvml's name
        pass

    def __init__(self, kind: int = 1, fail_init: bool = False) -> None:
        self.samples: list[tuple[int, float]] = []
        self.kind, self.fail_init, self.uuid = kind, fail_init, None

    def nvmlInit(self) -> None:
        if self.fail_init:
            raise self.NVMLError("NVML Shared Library Not Found")

    def nvmlDeviceGetHandleByUUID(self, uuid: str) -> str:
        self.uuid = uuid
        return "handle"

    def nvmlDeviceGetSamples(self, handle, kind: int, since: int):
        assert handle == "handle" and kind == self.NVML_GPU_UTILIZATION_SAMPLES
        fresh = [(t, v) for t, v in self.samples if t > since]
        if not fresh:
            raise self.NVMLError_NotFound("Not Found")  # NVML's answer when no sample is newer than `since`
        out = []
        for t, v in fresh:
            value = _Value()
            if self.kind == 0:
                value.dVal = v
            else:
                value.uiVal = int(v)
            out.append(SimpleNamespace(timeStamp=t, sampleValue=value))
        return self.kind, out


def test_each_window_averages_only_its_own_samples():
    nvml = FakeNvml()
    meter = NvmlBusy(nvml, "handle")
    nvml.samples += [(10, 0), (20, 0)]  # before the window
    meter.mark()
    nvml.samples += [(30, 60), (40, 80), (50, 100)]
    assert meter.read() == pytest.approx(0.8)
    nvml.samples += [(60, 50)]
    assert meter.read() is None  # one sample since the last read: too few to say
    nvml.samples += [(70, 10), (80, 30)]
    assert meter.read() == pytest.approx(0.2)  # the lone sample was used up by the read that refused it
    assert meter.read() is None  # nothing new: NVML's NOT_FOUND, not an exception out of the training loop


def test_samples_of_another_value_type_are_read_from_their_own_field():
    nvml = FakeNvml(kind=0)
    meter = NvmlBusy(nvml, "handle")
    nvml.samples += [(1, 40.5), (2, 59.5)]
    assert meter.read() == pytest.approx(0.5)


def test_a_gpu_without_any_sample_is_said_once():
    nvml = FakeNvml()
    meter = NvmlBusy(nvml, "handle")
    assert [meter.read() is None and meter.silent() for _ in range(4)] == [False, False, True, False]
    nvml.samples += [(1, 50)]
    later = NvmlBusy(nvml, "handle")
    later.read()
    assert not any(later.read() is None and later.silent() for _ in range(4))  # it had samples: a quiet spell


def test_loader_workers_are_found_through_wrappers():
    inner = SimpleNamespace(num_workers=3)
    assert loop.loader_workers(SimpleNamespace(loader=SimpleNamespace(loader=inner))) == 3
    assert loop.loader_workers(SimpleNamespace(loader=SimpleNamespace())) is None  # DeviceLoader-like: none


def test_no_meter_on_the_cpu_and_a_reason_where_nvml_is_missing(monkeypatch):
    assert open_meter(torch.device("cpu")) == gpu_busy.BusyMeter(None, "")
    monkeypatch.setitem(sys.modules, "pynvml", None)  # import pynvml raises ImportError
    missing = open_meter(torch.device("cuda", 0))
    assert missing.meter is None and "pip install nvidia-ml-py" in missing.why_not
    monkeypatch.setattr("hpctrain.dist.gpu_identity.device_identity", lambda device: "GPU-1234")
    broken = open_meter(torch.device("cuda", 0), nvml=FakeNvml(fail_init=True))
    assert broken.meter is None and "NVML has no handle for this GPU (NVML Shared Library" in broken.why_not


def test_the_meter_finds_the_gpu_by_its_uuid_and_waits_for_samples(monkeypatch):
    monkeypatch.setattr("hpctrain.dist.gpu_identity.device_identity", lambda device: f"GPU-of-{device.index}")
    nvml = FakeNvml()  # no sample yet (an idle GPU's buffer can be empty): NOT_FOUND, not "unsupported"
    found = open_meter(torch.device("cuda", 3), nvml=nvml)
    assert found.meter is not None and found.why_not == "" and nvml.uuid == "GPU-of-3"

    class Unsupported(FakeNvml):
        def nvmlDeviceGetSamples(self, handle, kind, since):
            raise self.NVMLError("Not Supported")

    refused = open_meter(torch.device("cuda", 0), nvml=Unsupported())
    assert refused.meter is None and "no utilisation samples here (Not Supported)" in refused.why_not


def test_host_bound_needs_an_idle_gpu_and_a_loader_that_kept_up():
    assert host_bound(0.5, 0.05)
    assert not host_bound(0.5, 0.4)  # the loader's: its own warning
    assert not host_bound(HOST_BOUND, 0.0) and not host_bound(None, 0.0)


def test_the_advice_suggests_only_what_the_run_could_change_to():
    one_gpu = StepFacts("eager", "", distributed=False, can_compile=True, grad_accum=1, micro_batch=16)
    eager = host_bound_advice(one_gpu)
    assert eager.startswith("Try: train.step_mode=auto (or graphed) captures the whole step")
    assert "train.compile=true" in eager and "(micro batch 16, no accumulation" in eager
    compiled = host_bound_advice(dataclasses.replace(one_gpu, mode="compiled", grad_accum=4))
    assert "train.compile" not in compiled and "(now 16, with 4 accumulation steps" in compiled
    fell_back = host_bound_advice(dataclasses.replace(one_gpu, capture_refusal="BatchInfo.step read inside"))
    assert "cannot be captured as a CUDA graph here (BatchInfo.step read inside). Try: train.compile" in fell_back
    assert "step_mode=auto" not in fell_back
    fsdp = host_bound_advice(StepFacts("eager", "dist.strategy=fsdp over 2 processes is not captured yet", True,
                                       can_compile=False, grad_accum=1, micro_batch=8))
    assert "train.compile" not in fsdp and "step_mode=graphed" not in fsdp
    ddp = host_bound_advice(StepFacts("eager", "", True, True, 2, 64))
    assert "DDP's all-reduce included (opt-in: it has not yet run on several GPUs)" in ddp
    graphed = host_bound_advice(dataclasses.replace(one_gpu, mode="graphed"))
    assert graphed.startswith("The step is already one CUDA graph replay") and "step_mode" not in graphed


def test_step_facts_read_the_step_that_runs_and_what_it_could_be():
    from hpctrain.train.precision import Precision
    from tests.unit.test_step_modes import BF16, _cfg, _runtime

    def ctx(cfg, stepper=None, device="cuda:0", precision=BF16):
        return SimpleNamespace(cfg=cfg, runtime=_runtime(device), precision=precision, stepper=stepper or object(),
                               experiment=SimpleNamespace(graphable=True),
                               batches=SimpleNamespace(grad_accum=2, micro_batch_size=32))

    explicit = loop.step_facts(ctx(_cfg("train.step_mode=compiled")))
    assert explicit.mode == "compiled" and explicit.capture_refusal == ""  # not only train.compile=true
    fell_back = loop.step_facts(ctx(_cfg(), SimpleNamespace(graph=None, failed="the batch holds object")))
    assert fell_back.mode == "eager" and fell_back.capture_refusal == "the batch holds object"
    assert loop.step_facts(ctx(_cfg(), SimpleNamespace(graph=object(), failed=""))).mode == "graphed"
    fp16 = Precision("fp16", torch.float16, "cuda")
    assert "GradScaler" in loop.step_facts(ctx(_cfg("train.precision=fp16"), precision=fp16)).capture_refusal
    assert not loop.step_facts(ctx(_cfg("dist.strategy=fsdp"))).can_compile
    assert (loop.step_facts(ctx(_cfg(), device="cpu")).grad_accum, loop.step_facts(ctx(_cfg())).micro_batch) == (2, 32)


# ---- in the training log ---------------------------------------------------------------------------------------

class Recorder:
    def __init__(self) -> None:
        self.records: list[dict] = []

    def log(self, record: dict) -> None:
        self.records.append(record)


def _ctx(stepper=None):
    from tests.unit.test_step_modes import BF16, _cfg

    return SimpleNamespace(runtime=single_process_runtime(torch.device("cpu")), cfg=_cfg(), metrics=Recorder(),
                           state=SimpleNamespace(step=0, epoch=0), total_steps=100, stepper=stepper or object(),
                           batches=SimpleNamespace(global_batch_size=32, micro_batch_size=32, grad_accum=1),
                           train_loader=None, precision=BF16, experiment=SimpleNamespace(graphable=True))


def _windows(ctx, busy: list[float], wait: float = 0.0, disturbed: frozenset = frozenset()) -> None:
    """One log window per value: the meter reports it; the ranks waited ``wait`` of each window for batches;
    the windows numbered in ``disturbed`` had other work in them (a validation, a checkpoint)."""
    nvml = FakeNvml()
    window = loop._Window(0, NvmlBusy(nvml, "handle"))
    t = 0
    for value in busy:
        for _ in range(3):
            t += 1
            nvml.samples.append((t, 100 * value))
        ctx.state.step += 10
        window.add(torch.tensor(1.0), None)
        window.data_wait = wait * 0.05
        window.started -= 0.05  # each window lasts at least 50 ms
        window.disturbed |= len(ctx.metrics.records) in disturbed
        loop.log_train(ctx, window)


def test_the_log_records_gpu_busy_and_warns_once_when_the_host_sets_the_pace(caplog):
    ctx = _ctx()
    with caplog.at_level(logging.WARNING, logger="hpctrain"):
        _windows(ctx, [0.3, 0.6, 0.5])
    # The launch's first window (warm-up, compilation, capture) has no number; then each window its own.
    assert [r.get("gpu_busy") for r in ctx.metrics.records] == [None, pytest.approx(0.6), pytest.approx(0.5)]
    warnings = [r.getMessage() for r in caplog.records if "host limits" in r.getMessage()]
    assert len(warnings) == 1  # once per launch
    assert "ran kernels 60% of it" in warnings[0]
    assert "cannot be captured as a CUDA graph here (CUDA graphs need a GPU" in warnings[0]  # this test's CPU


def test_a_window_with_more_than_steps_in_it_has_no_number_and_no_warning(caplog):
    ctx = _ctx()
    with caplog.at_level(logging.WARNING, logger="hpctrain"):
        _windows(ctx, [0.3, 0.4, 0.5], disturbed=frozenset({1}))  # e.g. a validation ran in the second window
    assert [r.get("gpu_busy") for r in ctx.metrics.records] == [None, None, pytest.approx(0.5)]
    assert "ran kernels 50% of it" in caplog.text


def test_no_host_warning_for_a_busy_gpu_or_a_waiting_loader(caplog):
    with caplog.at_level(logging.WARNING, logger="hpctrain"):
        _windows(_ctx(), [0.95, 0.95, 0.9])
        _windows(_ctx(), [0.2, 0.2], wait=0.6)
    assert not [r for r in caplog.records if "host limits" in r.getMessage()]


def test_a_replaying_graph_gets_advice_for_a_graphed_step(caplog):
    replaying = SimpleNamespace(graph=object(), failed="")
    with caplog.at_level(logging.WARNING, logger="hpctrain"):
        _windows(_ctx(replaying), [0.5, 0.5])
    assert "already one CUDA graph replay" in caplog.text


def test_cpu_runs_log_no_gpu_busy():
    ctx = _ctx()
    window = loop._Window(0)
    ctx.state.step = 5
    window.add(torch.tensor(1.0), None)
    loop.log_train(ctx, window)
    assert "gpu_busy" not in ctx.metrics.records[0]


# ---- in the report ---------------------------------------------------------------------------------------------

def _run(tmp_path, busy: float, wait: float):
    run = tmp_path / "run"
    run.mkdir(parents=True)
    records = [{"step": 10 * i, "split": "train", "loss": 1.0, "samples_per_s": 100.0, "gpu_busy": busy,
                "data_wait_frac": wait, "time": i} for i in range(1, 6)]
    records[0]["gpu_busy"] = 0.05  # an odd window: the median does not follow it
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return run


def test_the_report_names_a_host_bound_run_and_plots_its_gpu_busy(tmp_path):
    run = _run(tmp_path, busy=0.6, wait=0.02)
    out = write_report(run)
    summary = (out / "summary.md").read_text()
    assert "GPU busy in training (NVML kernel time, median of the log windows, mean of the ranks): 60%" in summary
    assert "the host (kernel launches, Python, autograd) set the pace" in summary
    assert "No GPU monitor logs" not in summary
    assert (out / "overview.png").read_bytes()[:4] == b"\x89PNG"


def test_the_report_blames_the_loader_or_nothing(tmp_path):
    loader = observations(summary_facts(load_run(_run(tmp_path / "a", busy=0.5, wait=0.4))))
    assert any("the data loader set the pace" in n for n in loader)
    busy = summary_facts(load_run(_run(tmp_path / "b", busy=0.97, wait=0.0)))
    assert busy["gpu_busy_median"] == pytest.approx(0.97) and not observations(busy)
    busy["gpu_busy_median"] = math.nan  # a CPU run: no number, no note
    assert not observations(busy)


def test_in_a_real_loop_windows_with_a_validation_have_no_number(tmp_path, monkeypatch):
    """loop.train on the tiny DDPM with a stand-in NVML that samples 50% busy between any two reads: the windows
    whose step ran a validation or a checkpoint (after_step marks them) and the launch's first have no gpu_busy."""
    from hpctrain.monitor.gpu_busy import BusyMeter
    from tests.unit.test_step_modes import _context

    class Sampling(FakeNvml):
        def nvmlDeviceGetSamples(self, handle, kind, since):
            self.samples += [(len(self.samples) + 1 + k, 50) for k in range(3)]
            return super().nvmlDeviceGetSamples(handle, kind, since)

    ctx = _context(tmp_path, monkeypatch, "log.every_steps=1", "eval.every_steps=2", "ckpt.every_steps=0",
                   "train.max_steps=5", "log.outputs_every_steps=0", "log.outputs_every_epochs=0",
                   "model.fixture_samples=64")
    ctx.checkpointer = type("NoSave", (), {"save": lambda self, *a, **k: None})()
    monkeypatch.setattr(loop, "open_meter", lambda device: BusyMeter(NvmlBusy(Sampling(), "handle")))
    records: list[dict] = []
    monkeypatch.setattr(ctx.metrics, "log", records.append)
    loop.train(ctx)
    busy = {r["step"]: r.get("gpu_busy") for r in records if r["split"] == "train"}
    # step 1: the launch's first window; 3 and 5: the windows after the validations at steps 2 and 4.
    assert [s for s, b in busy.items() if b is None] == [1, 3, 5], busy
    assert busy[2] == pytest.approx(0.5)
