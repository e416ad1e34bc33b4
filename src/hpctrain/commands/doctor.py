"""`hpctrain doctor`: the launch environment's checks on this node (hpctrain.doctor), or with --perf the
performance pre-flight on every rank (perf/preflight.py), its local ranks started through torchrun."""

from __future__ import annotations

import argparse
import json
import socket
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from hpctrain.errors import UserError

if TYPE_CHECKING:
    from hpctrain.perf.preflight import Thresholds


def add_parser(sub) -> None:
    doctor = sub.add_parser("doctor", help="check the launch environment (inside a job: on every node via srun); "
                            "--perf measures bandwidth, matmul throughput and stragglers")
    doctor.add_argument("--json", action="store_true", help="print the findings as JSON")
    doctor.add_argument("--perf", action="store_true",
                        help="performance pre-flight on all ranks: all-reduce bandwidth (1 KiB up to --max-size), matrix "
                        "multiply TFLOP/s per rank, stragglers; writes preflight.json and preflight.md to --out")
    doctor.add_argument("--nproc-per-node", type=int, default=0, metavar="N", help="--perf: start N local ranks (torchrun)")
    doctor.add_argument("--out", default="", metavar="DIR", help="--perf: report directory (default runs/preflight-TIME)")
    doctor.add_argument("--max-size", default="0", metavar="SIZE",
                        help="--perf: largest all-reduce message (default 1GiB on GPUs, 64MiB on CPUs)")
    doctor.add_argument("--min-busbw", type=float, default=0.0, metavar="GB/s", help="--perf: fail below this bus bandwidth")
    doctor.add_argument("--min-tflops", type=float, default=0.0, metavar="TFLOP/s",
                        help="--perf: fail when a rank's matrix multiply is below this")
    doctor.add_argument("--max-straggler", type=float, default=1.5, metavar="RATIO",
                        help="--perf: fail when the slowest rank needs this many times the median time (default 1.5)")
    doctor.add_argument("--data", default="", metavar="PATH",
                        help="--perf: also probe reading this data directory, all ranks at once (file opens/s, MB/s)")
    doctor.add_argument("--data-size", default="256MiB", metavar="SIZE", help="--perf: bytes each rank reads of --data")
    doctor.add_argument("--min-read-mbps", type=float, default=0.0, metavar="MB/s",
                        help="--perf: fail when a rank reads --data slower than this")
    doctor.add_argument("--debug", action="store_true", help="show tracebacks")
    doctor.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    if not args.perf:
        return environment_checks(as_json=args.json)
    from hpctrain.logs import setup_logging
    from hpctrain.perf.preflight import Thresholds
    from hpctrain.units import parse_size

    setup_logging(debug=args.debug)
    if args.max_straggler < 1:
        raise UserError(f"--max-straggler {args.max_straggler} is below 1", "it is the slowest / median ratio, e.g. 1.5.")
    thresholds = Thresholds(args.min_busbw, args.min_tflops, args.max_straggler, args.min_read_mbps)
    return perf_command(PerfRequest(args.nproc_per_node, args.out, parse_size(args.max_size), thresholds,
                                    args.data, parse_size(args.data_size)))


def environment_checks(as_json: bool = False) -> int:
    """This node's checks, printed (one line each, or JSON); 1 when one failed."""
    from hpctrain.doctor import run_checks

    host = socket.gethostname().split(".")[0]
    checks = run_checks()
    if as_json:
        print(json.dumps({"host": host, "checks": [asdict(c) for c in checks]}))
    else:
        for c in checks:
            print(c.format(host))
    failed = [c for c in checks if c.status == "fail"]
    if failed:
        print(f"hpctrain doctor: {len(failed)} check(s) failed on {host}", file=sys.stderr)
    return 1 if failed else 0


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
    """The pre-flight on every rank: started here through torchrun (--nproc-per-node), or as launched."""
    from hpctrain.config.schema import DistSection
    from hpctrain.dist.env import detect_launch
    from hpctrain.dist.runtime import distributed_session
    from hpctrain.perf.preflight import Settings, run_preflight

    if req.nproc_per_node < 0:
        raise UserError(f"--nproc-per-node must be positive, got {req.nproc_per_node}")
    if req.data and not Path(req.data).is_dir():
        raise UserError(f"--data '{req.data}' is not a directory", "give the directory training reads (e.g. the shards).")
    out = req.out or f"runs/preflight-{time.strftime('%Y%m%d-%H%M%S')}"
    launch = detect_launch()
    if launch.launcher == "single" and req.nproc_per_node > 1:
        # Every rank gets the same report directory, chosen here once.
        from hpctrain.launcher.torchrun import launch_local

        return launch_local(req.nproc_per_node, req.worker_args(str(Path(out).resolve())))
    import torch

    max_bytes = req.max_bytes or ((1 << 30) if torch.cuda.is_available() else (64 << 20))
    with distributed_session(launch, DistSection()) as runtime:
        settings = Settings(max_bytes=max_bytes, data_path=req.data, data_bytes=req.data_bytes)
        return run_preflight(runtime, settings, req.thresholds, Path(out))
