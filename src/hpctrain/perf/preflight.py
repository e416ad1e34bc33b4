"""`hpctrain doctor --perf`: measure what a distributed run will get before it runs.

Runs on every rank (``hpctrain doctor --perf --nproc-per-node N`` locally, or under srun/torchrun in a
job): an environment report per node, all-reduce bandwidth over message sizes, matrix-multiply
throughput per rank, and a straggler check. Rank 0 judges the results against the user's thresholds
and writes ``preflight.json`` and ``preflight.md``; the exit code is 1 when a check fails.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from hpctrain.atomic import atomic_write_text
from hpctrain.doctor import Check
from hpctrain.dist.collectives import broadcast_object, gather_objects
from hpctrain.dist.env import cpus_available
from hpctrain.dist.runtime import Runtime
from hpctrain.perf.measure import (
    BandwidthRow, Straggler, all_reduce_bandwidth, data_read_probe, matmul_tflops, message_sizes, straggler_check,
)
from hpctrain.perf.peaks import dense_peak, describe


@dataclass(frozen=True)
class Thresholds:
    min_busbw_gbps: float = 0.0
    """Fail when the bus bandwidth of the largest message is below this (0: report only)."""
    min_tflops: float = 0.0
    """Fail when any rank's matrix-multiply throughput is below this (0: report only)."""
    max_straggler: float = 1.5
    """Fail when the slowest rank takes this many times the median rank's time (warn above 1.2)."""
    min_read_mbps: float = 0.0
    """Fail when a rank reads the data path slower than this, all ranks at once (0: report only)."""


@dataclass(frozen=True)
class Settings:
    min_bytes: int = 1 << 10
    """Smallest all-reduce message."""
    max_bytes: int = 1 << 30
    """Largest all-reduce message (1 GiB on GPUs; the CLI lowers it on CPUs)."""
    matmul_n: int = 0
    """Matrix size for the throughput and straggler tests; 0: 8192 on GPUs, 512 on CPUs."""
    data_path: str = ""
    """Data directory to probe (shards or files, on the file system training will read); '' skips the probe."""
    data_bytes: int = 256 << 20
    """Bytes each rank reads in the data probe."""


def environment() -> dict[str, Any]:
    """What this process sees: versions, devices, CPUs, network interfaces, NCCL_* and SLURM_* variables."""
    cuda = torch.cuda.is_available()
    info: dict[str, Any] = {
        "host": socket.gethostname().split(".")[0],
        "torch": torch.__version__,
        "cuda": torch.version.cuda if cuda else None,
        "nccl": ".".join(map(str, torch.cuda.nccl.version())) if cuda else None,
        "gpus": [f"{torch.cuda.get_device_name(i)} ({torch.cuda.get_device_properties(i).total_memory / 2**30:.0f} GiB)"
                 for i in range(torch.cuda.device_count())] if cuda else [],
        "cpus_usable": cpus_available(),
        "interfaces": sorted(name for _, name in socket.if_nameindex()),
        "variables": {k: v for k, v in sorted(os.environ.items()) if k.startswith(("NCCL_", "SLURM_"))},
    }
    return info


def run_preflight(runtime: Runtime, settings: Settings, thresholds: Thresholds, out_dir: Path) -> int:
    """Collective. Returns the exit code (1 when a check fails), the same on every rank."""
    gpu = runtime.device.type == "cuda"
    dtype = matmul_dtype(runtime.device)
    n = settings.matmul_n or (8192 if gpu else 512)
    envs = gather_objects(environment(), runtime)
    # One process: an all-reduce of one rank moves no data (it returns at memory speed, 140 TB/s on an H100), so
    # there is no bandwidth to measure or to report.
    rows = all_reduce_bandwidth(runtime, message_sizes(settings.min_bytes, settings.max_bytes)) \
        if runtime.world_size > 1 else []
    measured = gather_objects((matmul_tflops(runtime.device, n, dtype), device_name(runtime.device)), runtime)
    tflops, names = [t for t, _ in measured], [name for _, name in measured]
    straggler = straggler_check(runtime, n, dtype)
    data = gather_objects(asdict(data_read_probe(runtime, settings.data_path, settings.data_bytes)), runtime) \
        if settings.data_path else []
    short = str(dtype).replace("torch.", "").replace("bfloat16", "bf16").replace("float16", "fp16")
    worst = min(range(len(tflops)), key=tflops.__getitem__)
    peak_note = describe(tflops[worst], names[worst], short) if gpu else ""
    checks = judge(rows, tflops, straggler, thresholds, runtime.world_size, peak_note) + judge_data(data, thresholds)
    if runtime.is_main:
        report = {
            "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "world_size": runtime.world_size,
            "backend": runtime.backend or "none",
            "device": runtime.device.type,
            "dtype": str(dtype).replace("torch.", ""),
            "matmul_n": n,
            "thresholds": asdict(thresholds),
            "checks": [asdict(c) for c in checks],
            "bandwidth": [asdict(r) for r in rows],
            "tflops_per_rank": tflops,
            "device_per_rank": names,
            "peak": peak_report(tflops[worst], names[worst], short) if gpu else None,
            "straggler": asdict(straggler),
            "data_path": settings.data_path,
            "data": data,
            "ranks": envs,
        }
        out_dir.mkdir(parents=True, exist_ok=True)
        atomic_write_text(out_dir / "preflight.json", json.dumps(report, indent=1) + "\n")
        atomic_write_text(out_dir / "preflight.md", render_markdown(report))
        print(render_markdown(report), end="")
        print(f"report: {out_dir / 'preflight.md'} and preflight.json", file=sys.stderr)
    failed = any(c.status == "fail" for c in checks)
    return int(broadcast_object(1 if failed else 0, runtime))


def matmul_dtype(device: torch.device) -> torch.dtype:
    """bf16 on GPUs with bf16 tensor cores (compute capability 8.0 up), fp16 on older ones (V100: bf16 runs
    there without tensor cores, far below any peak), float32 on CPUs."""
    if device.type != "cuda":
        return torch.float32
    return torch.bfloat16 if torch.cuda.get_device_capability(device)[0] >= 8 else torch.float16


def device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def peak_report(measured: float, name: str, dtype: str) -> dict[str, Any]:
    """The slowest rank's GEMM rate against its GPU's dense peak (gpu 'unknown' for a GPU not in perf/peaks.py;
    fraction None when unknown or measured in another dtype than the peak's)."""
    peak = dense_peak(name)
    if peak is None:
        return {"device": name, "gpu": "unknown", "dtype": dtype, "tflops": None, "fraction": None,
                "detail": describe(measured, name, dtype)}
    fraction = measured / peak.tflops if peak.dtype == dtype else None
    return {"device": name, "gpu": peak.gpu, "dtype": peak.dtype, "tflops": peak.tflops, "fraction": fraction,
            "detail": describe(measured, name, dtype)}


def judge(rows: list[BandwidthRow], tflops: list[float], straggler: Straggler, t: Thresholds, world: int,
          peak_note: str = "") -> list[Check]:
    checks = []
    if world > 1 and rows:
        top = rows[-1]
        detail = f"{top.busbw_gbps:.2f} GB/s bus bandwidth at {_size(top.bytes)} ({top.algbw_gbps:.2f} GB/s algorithm)"
        if t.min_busbw_gbps and top.busbw_gbps < t.min_busbw_gbps:
            checks.append(Check("all-reduce bandwidth", "fail", f"{detail}, below the required {t.min_busbw_gbps:g} GB/s: "
                                "check NCCL_SOCKET_IFNAME / InfiniBand (NCCL_DEBUG=INFO shows the transport)"))
        else:
            checks.append(Check("all-reduce bandwidth", "pass", detail))
    else:
        checks.append(Check("all-reduce bandwidth", "skip", "one process: nothing to measure"))
    worst = min(range(len(tflops)), key=tflops.__getitem__)
    detail = f"slowest rank {worst}: {tflops[worst]:.2f} TFLOP/s (all ranks: {', '.join(f'{x:.2f}' for x in tflops)})"
    if peak_note:
        detail += f"; {peak_note}"
    if t.min_tflops and tflops[worst] < t.min_tflops:
        checks.append(Check("matrix multiply", "fail", f"{detail}, below the required {t.min_tflops:g}: "
                            "a throttled or shared GPU (nvidia-smi -q -d PERFORMANCE,CLOCK)"))
    else:
        checks.append(Check("matrix multiply", "pass", detail))
    detail = f"rank {straggler.slowest_rank} takes {straggler.ratio:.2f}x the median rank's time for the same work"
    if straggler.ratio > t.max_straggler:
        checks.append(Check("stragglers", "fail", f"{detail} (limit {t.max_straggler:g}): every DDP step waits for it"))
    elif straggler.ratio > 1.2:
        checks.append(Check("stragglers", "warn", f"{detail}: every DDP step waits for the slowest rank"))
    else:
        checks.append(Check("stragglers", "pass", detail))
    return checks


def judge_data(probes: list[dict[str, Any]], t: Thresholds) -> list[Check]:
    """The data probe's verdict: the slowest rank's read rate, and a word on many small files."""
    if not probes:
        return []
    files = sum(d["files"] for d in probes)
    if files == 0:
        return [Check("data read", "fail", "no files under the data path: check --data")]
    mean = sum(d["files"] * d["mean_file_bytes"] for d in probes) / files
    worst = min(range(len(probes)), key=lambda r: probes[r]["read_mbps"])
    p = probes[worst]
    detail = (f"slowest rank {worst}: {p['read_mbps']:.0f} MB/s sequential, {p['opens_per_s']:.0f} file opens/s "
              f"({files} files, {_size(int(mean))} on average)")
    if t.min_read_mbps and p["read_mbps"] < t.min_read_mbps:
        return [Check("data read", "fail", f"{detail}, below the required {t.min_read_mbps:g} MB/s: stage the data "
                      "to node-local disk, or use fewer loader workers per node")]
    if files >= 10_000 and mean < (1 << 20):
        return [Check("data read", "warn", f"{detail}: many small files cost a metadata operation each; pack them "
                      "into shards (hpctrain shard)")]
    return [Check("data read", "pass", detail)]


def _size(n: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:g} {unit}"
    return f"{n} B"


def _bandwidth_lines(report: dict[str, Any]) -> list[str]:
    if report["world_size"] < 2 or not report["bandwidth"]:
        return ["Not measured: one process has no peer to exchange data with (its all-reduce only returns the input). "
                "Run `hpctrain doctor --perf --nproc-per-node N` on a node's GPUs, or under srun across nodes."]
    lines = ["| size | time (us) | algbw (GB/s) | busbw (GB/s) |", "|---:|---:|---:|---:|"]
    lines += [f"| {_size(r['bytes'])} | {r['time_us']:.1f} | {r['algbw_gbps']:.3f} | {r['busbw_gbps']:.3f} |"
              for r in report["bandwidth"]]
    return lines + ["", "busbw = algbw x 2(n-1)/n (nccl-tests' definition); time is the slowest rank's median."]


def render_markdown(report: dict[str, Any]) -> str:
    """The human report (a pure function of the JSON report)."""
    lines = [f"# hpctrain pre-flight, {report['time']}", "",
             f"{report['world_size']} process(es), backend {report['backend']}, {report['device']}, "
             f"matmul {report['matmul_n']}x{report['matmul_n']} {report['dtype']}", "", "## Checks", "",
             "| check | status | detail |", "|---|---|---|"]
    lines += [f"| {c['name']} | {c['status'].upper()} | {c['detail']} |" for c in report["checks"]]
    lines += ["", "## All-reduce (float32, sum)", ""] + _bandwidth_lines(report) + ["", "## Ranks", "", "| rank | host | TFLOP/s | straggler step (s) | GPUs | CPUs |", "|---:|---|---:|---:|---|---:|"]
    for rank, env in enumerate(report["ranks"]):
        lines.append(f"| {rank} | {env['host']} | {report['tflops_per_rank'][rank]:.2f} | "
                     f"{report['straggler']['times_s'][rank]:.4f} | {', '.join(env['gpus']) or '-'} | {env['cpus_usable']} |")
    if report.get("peak"):
        lines += ["", f"Matrix multiply against the GPU's table peak (slowest rank): {report['peak']['detail']}."]
    if report.get("data"):
        lines += ["", f"## Data read ({report['data_path']}, all ranks at once, page cache dropped)", "",
                  "| rank | files | opens/s | read MB/s | bytes read |", "|---:|---:|---:|---:|---:|"]
        lines += [f"| {rank} | {d['files']} | {d['opens_per_s']:.0f} | {d['read_mbps']:.1f} | {_size(d['bytes_read'])} |"
                  for rank, d in enumerate(report["data"])]
    first = report["ranks"][0]
    lines += ["", f"torch {first['torch']}, CUDA {first['cuda'] or '-'}, NCCL {first['nccl'] or '-'}; "
              f"interfaces on {first['host']}: {', '.join(first['interfaces'])}", ""]
    return "\n".join(lines)
