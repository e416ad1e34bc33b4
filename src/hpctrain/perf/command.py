"""CLI glue of `hpctrain doctor --perf`: launch the ranks (locally through torchrun), run, report."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

from hpctrain.config.schema import DistSection
from hpctrain.dist.env import detect_launch
from hpctrain.dist.runtime import distributed_session
from hpctrain.errors import UserError
from hpctrain.perf.preflight import Settings, Thresholds, run_preflight


@dataclass(frozen=True)
class PerfRequest:
    nproc_per_node: int
    """Local processes to start through torchrun (0: as launched)."""
    out: str
    """Report directory ('' picks runs/preflight-<time>)."""
    max_bytes: int
    """Largest all-reduce message; 0 picks 1 GiB on GPUs, 64 MiB on CPUs."""
    thresholds: Thresholds
    """Pass/fail limits."""
    data: str = ""
    """Data directory to probe ('' skips the probe)."""
    data_bytes: int = 256 << 20
    """Bytes each rank reads of it."""

    def worker_args(self, out: str) -> list[str]:
        t = self.thresholds
        return ["doctor", "--perf", "--out", out, "--max-size", str(self.max_bytes), "--min-busbw", str(t.min_busbw_gbps),
                "--min-tflops", str(t.min_tflops), "--max-straggler", str(t.max_straggler),
                "--min-read-mbps", str(t.min_read_mbps), "--data-size", str(self.data_bytes)] + \
            (["--data", str(Path(self.data).resolve())] if self.data else [])


def perf_command(req: PerfRequest) -> int:
    if req.nproc_per_node < 0:
        raise UserError(f"--nproc-per-node must be positive, got {req.nproc_per_node}")
    if req.data and not Path(req.data).is_dir():
        raise UserError(f"--data '{req.data}' is not a directory", "give the directory training reads (e.g. the shards).")
    out = req.out or f"runs/preflight-{time.strftime('%Y%m%d-%H%M%S')}"
    launch = detect_launch()
    if launch.launcher == "single" and req.nproc_per_node > 1:
        # Every rank gets the same report directory, chosen here once.
        from hpctrain.launch import launch_local

        return launch_local(req.nproc_per_node, req.worker_args(str(Path(out).resolve())))
    import torch

    max_bytes = req.max_bytes or ((1 << 30) if torch.cuda.is_available() else (64 << 20))
    with distributed_session(launch, DistSection()) as runtime:
        settings = Settings(max_bytes=max_bytes, data_path=req.data, data_bytes=req.data_bytes)
        return run_preflight(runtime, settings, req.thresholds, Path(out))
