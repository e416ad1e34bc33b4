"""Everything only a GPU shows, in one command: `make gpu-check` on a GPU node (about 15 minutes on one H100), or
`make gpu-check-quick` (--quick) in at most 8 minutes, compilation included, for a short allocation.

    python tools/gpu_check.py [--quick] [--out DIR] [--only STAGE,...] [--skip STAGE,...] [--budget-s S]
                              [--faces-dir DIR] [--archive PATH] [--list]

Writes everything under one folder: --out, else $GPU_CHECK_DIR, else gpu-check-results/<date>-<host>/. In it:
environment.json (device, driver, torch, CUDA, NCCL, cuDNN, date, host, commit), one log per stage (NN-stage.log,
opening with the same environment header), the stages' own reports (pytest's junit xml, run dirs, the
pre-flight report), summary.md / summary.json with the table this prints at the end (stage, status
pass / fail / skip / cut, key numbers, seconds), and results.tar.gz holding all of it. The summary and the archive
are rewritten after every stage, so a check killed at its allocation's limit still leaves everything it measured
(--archive PATH writes the archive there as well, e.g. to the one folder a job's files come back from).

--quick runs the stages of QUICK in order of value within --budget-s (default 480 s): correctness first (tests/gpu
in three concurrent pytest processes, at most 3 minutes), then the two reference experiments' throughput (eager,
short windows; the face-parsing end-to-end rows from a face set generated on a CPU machine beforehand, --faces-dir,
else generated here), then the checkpoint stall, the pre-flight and the two-process runs. docs/gpu.md says what to
carry to a node without network.

Each stage is a subprocess with its own timeout (its whole process tree is killed at the limit); a failing
stage does not stop the others; the exit code is 1 when a stage failed or was cut, else 0. Without a CUDA device
every stage is skipped ("no CUDA device: skipped; run on a GPU node") and the command exits 0 in seconds.

The stages are the lists STAGES and QUICK below; to add one, append a Stage (a command, a timeout, when to skip it,
and how to read its key numbers from its output).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shlex
import signal
import socket
import subprocess
import sys
import tarfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

from hpctrain.provenance import source_commit
from hpctrain.proctree import descendants, kill_tree

ROOT = Path(__file__).resolve().parent.parent
# The decision records the full check still reruns on a GPU (benchmarks/archive/2026-11/README.md).
ARCHIVE = "benchmarks/archive/2026-11"
# hpctrain trains on the GPU there while the plain loop and the peers run on the CPU: not like with like.
OVERHEAD_CPU_ONLY = "its plain loop and peers run on the CPU only, so on a GPU the ratio would compare devices"
NO_CUDA = "no CUDA device: skipped; run on a GPU node"
ONE_GPU_NCCL = ("one GPU: NCCL refuses two ranks on one GPU ('Duplicate GPU detected', NCCL >= 2.5); "
                "needs 2 GPUs (the shared-GPU stage runs 2 ranks on it over gloo)")


@dataclass
class Context:
    """What the stages are run with."""

    out: Path
    """The results folder."""
    env: dict
    """environment.json's content."""
    python: str = sys.executable
    header: str = ""
    """The environment header every stage log opens with."""
    faces_dir: str = ""
    """A face set made beforehand for the face-parsing end-to-end rows (benchmarks/faceseg_throughput.py --workdir)."""
    _help_cache: dict = field(default_factory=dict)

    @property
    def gpus(self) -> int:
        return int(self.env.get("gpu_count") or 0)

    def help_of(self, script: str) -> str:
        """`python SCRIPT --help`, to call a benchmark with the options it has (others edit them)."""
        if script not in self._help_cache:
            try:
                done = subprocess.run([self.python, str(ROOT / script), "--help"], capture_output=True, text=True,
                                      timeout=120, cwd=ROOT)
                self._help_cache[script] = done.stdout
            except (OSError, subprocess.TimeoutExpired):
                self._help_cache[script] = ""
        return self._help_cache[script]


@dataclass
class Stage:
    name: str
    command: Callable[[Context], list[str]]
    """argv of the stage, run in the repository root."""
    timeout_s: float
    skip: Callable[[Context], str] = lambda ctx: NO_CUDA if ctx.gpus == 0 else ""
    """Why the stage is skipped here ('' runs it). Default: skipped without a CUDA device."""
    numbers: Callable[[Context, str], tuple[str, str]] = lambda ctx, output: ("", "")
    """(key numbers, problem) from the stage's output and files; a problem fails a stage that exited 0."""
    env: Callable[[Context], dict] = lambda ctx: {}
    """Extra environment variables."""


@dataclass
class Result:
    stage: str
    status: str
    """pass, fail or skip."""
    numbers: str
    """Key numbers, or the reason for a skip or a failure."""
    seconds: float
    log: str = ""
    command: str = ""


# ---- environment ----------------------------------------------------------------------------------------------

def collect_environment() -> dict:
    """This process's view (run in a subprocess by the check, so that a broken driver cannot hang it)."""
    import torch

    from hpctrain.perf.preflight import environment

    cuda = torch.cuda.is_available()
    info = environment()
    info.update({
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "gpu_count": torch.cuda.device_count() if cuda else 0,
        "device": torch.cuda.get_device_name(0) if cuda else "cpu",
        "capability": ".".join(map(str, torch.cuda.get_device_capability(0))) if cuda else None,
        "cudnn": torch.backends.cudnn.version() if cuda else None,
        "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
        "driver": _nvidia_smi("driver_version") if cuda else None,
    })
    return info


def _nvidia_smi(field_name: str) -> str | None:
    try:
        done = subprocess.run(["nvidia-smi", f"--query-gpu={field_name}", "--format=csv,noheader"],
                              capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout.splitlines()[0].strip() if done.returncode == 0 and done.stdout.strip() else None


def query_environment(python: str, timeout_s: float = 180) -> dict:
    started = time.time()
    try:
        done = subprocess.run([python, str(Path(__file__).resolve()), "--print-environment"], capture_output=True,
                              text=True, timeout=timeout_s, cwd=ROOT)
        env = json.loads(done.stdout) if done.returncode == 0 else {"error": done.stderr.strip()[-2000:]}
    except subprocess.TimeoutExpired:
        env = {"error": f"querying torch and CUDA took over {timeout_s:g} s (a hung driver?)"}
    except ValueError as err:
        env = {"error": f"unreadable environment: {err}"}
    env.setdefault("date", time.strftime("%Y-%m-%dT%H:%M:%S%z"))
    env.setdefault("host", socket.gethostname().split(".")[0])
    env["commit"] = source_commit(ROOT)
    env["query_s"] = round(time.time() - started, 1)
    return env


def header(env: dict) -> str:
    gpus = env.get("gpu_count") or 0
    device = f"{env.get('device')} x{gpus}" if gpus else "no CUDA device"
    return (f"# hpctrain gpu-check | {env.get('date')} | host {env.get('host')} | {device} | driver "
            f"{env.get('driver') or '-'} | torch {env.get('torch', '?')} | CUDA {env.get('cuda') or '-'} | NCCL "
            f"{env.get('nccl') or '-'} | commit {env.get('commit') or '-'}")


# ---- key numbers ----------------------------------------------------------------------------------------------

def pytest_numbers(ctx: Context, output: str) -> tuple[str, str]:
    lines = [line.strip("= ") for line in output.splitlines() if re.search(r"\d+ (passed|failed|skipped|error)", line)]
    return (lines[-1] if lines else ""), ""


def _records(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            continue
    return out


def train_numbers(run: str, expect: str, min_accuracy: float = 0.9) -> Callable[[Context, str], tuple[str, str]]:
    """Final validation accuracy and median samples/s of a digits run; a problem when it ran elsewhere than
    `expect` (e.g. 'single/cuda') or learnt less than min_accuracy (the CPU demo reaches 1.0)."""

    def read(ctx: Context, output: str) -> tuple[str, str]:
        records = _records(ctx.out / run)
        val = [r for r in records if r.get("split") == "val" and "accuracy" in r]
        rates = sorted(r["samples_per_s"] for r in records if r.get("split") == "train" and "samples_per_s" in r)
        parts = [f"val accuracy {val[-1]['accuracy']:.4f}" if val else "no val record"]
        if rates:
            parts.append(f"{rates[len(rates) // 2]:,.0f} samples/s")
        problem = ""
        if expect not in output:
            problem = f"expected a '{expect}' run (see the log)"
        elif not val or val[-1]["accuracy"] < min_accuracy:
            problem = f"validation accuracy below {min_accuracy}"
        return ", ".join(parts), problem

    return read


def _table_row(output: str, loop: str) -> list[str]:
    for line in output.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) >= 2 and cells[0] == loop:
            return cells
    return []


def overhead_numbers(ctx: Context, output: str) -> tuple[str, str]:
    row = _table_row(output, "hpctrain")
    if not row:
        return "", "no hpctrain row in the table"
    text = "hpctrain " + ", ".join(c for c in row[1:] if c)
    if "--device" not in ctx.help_of("benchmarks/overhead.py"):
        text += " (peers on CPU/gloo: overhead_worker.py has no GPU path yet; hpctrain on CUDA)"
    return text, ""


def checkpoint_numbers(ctx: Context, output: str) -> tuple[str, str]:
    ratio = re.search(r"async stall / sync stall: ([0-9.]+)", output)
    resume = re.search(r"resume .*?: ([0-9,]+) \[", output)
    sync, asyn = _table_row(output, "sync"), _table_row(output, "async")
    parts = []
    if sync and asyn:
        parts.append(f"stall sync {sync[1].split(' ')[0]} ms, async {asyn[1].split(' ')[0]} ms")
    if ratio:
        parts.append(f"ratio {ratio.group(1)} (goal <= 0.1)")
    if resume:
        parts.append(f"resume {resume.group(1)} ms")
    return ", ".join(parts), "" if ratio else "no stall ratio in the output"


def preflight_numbers(ctx: Context, output: str) -> tuple[str, str]:
    path = ctx.out / "doctor-perf" / "preflight.json"
    if not path.exists():
        return "", "no preflight.json"
    report = json.loads(path.read_text())
    slowest = min(report["tflops_per_rank"])
    parts = [f"{slowest:.1f}" if slowest >= 10 else f"{slowest:.3g}"]
    parts[0] += f" {report['dtype']} TFLOP/s (slowest rank)"
    peak = report.get("peak") or {}
    if peak.get("fraction") is not None:
        parts.append(f"{peak['fraction']:.0%} of {peak['gpu']} peak {peak['tflops']:g}")
    elif peak:
        parts.append(f"peak {peak.get('gpu', 'unknown')}")
    if report["world_size"] > 1 and report["bandwidth"]:
        top = report["bandwidth"][-1]
        parts.append(f"busbw {top['busbw_gbps']:.1f} GB/s at {top['bytes'] >> 20} MiB x{report['world_size']} ranks")
    else:
        parts.append("busbw: 1 rank, not measured")
    failed = [c["name"] for c in report["checks"] if c["status"] == "fail"]
    return ", ".join(parts), f"failed checks: {', '.join(failed)}" if failed else ""


def table_numbers(ctx: Context, output: str) -> tuple[str, str]:
    """A benchmark's markdown table, one 'name first-number last-cell' per row; else its last line."""
    rows = []
    for line in output.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")] if line.lstrip().startswith("|") else []
        if len(cells) < 2 or set(cells[0]) <= set("-: ") or not cells[1] or not cells[1][0].isdigit():
            continue  # not a row, a header or a separator
        rows.append(" ".join([cells[0], cells[1].split(" ")[0]] + ([f"({cells[-1]})"] if len(cells) > 2 else [])))
    if rows:
        return "; ".join(rows), ""
    lines = [line for line in output.splitlines() if line.strip() and not line.startswith("#")]
    return (lines[-1].strip()[:120] if lines else ""), ""


# ---- skip conditions -----------------------------------------------------------------------------------------

def needs_gpus(n: int, why: str = "") -> Callable[[Context], str]:
    def skip(ctx: Context) -> str:
        if ctx.gpus == 0:
            return NO_CUDA
        return "" if ctx.gpus >= n else why or f"needs {n} GPUs, {ctx.gpus} visible"

    return skip


def needs_option(script: str, option: str, why: str = "") -> Callable[[Context], str]:
    def skip(ctx: Context) -> str:
        if ctx.gpus == 0:
            return NO_CUDA
        return "" if option in ctx.help_of(script) else f"{script} has no {option} option yet: skipped ({why})"

    return skip


# ---- the stages ----------------------------------------------------------------------------------------------

def _train(run: str, nproc: int = 1, *overrides: str) -> Callable[[Context], list[str]]:
    """`hpctrain train digits` (the demo: 20 epochs, 100% validation accuracy on the CPU) into OUT/run."""
    launch = ["--nproc-per-node", str(nproc)] if nproc > 1 else []
    return lambda ctx: [ctx.python, "-m", "hpctrain", "train", "digits", *launch, f"run.dir={ctx.out / run}",
                        *overrides]


def _overhead(model: str | None) -> Callable[[Context], list[str]]:
    def command(ctx: Context) -> list[str]:
        cmd = [ctx.python, "benchmarks/overhead.py", "--repeats", "3", "--nproc", "2" if ctx.gpus >= 2 else "1"]
        if model:
            cmd += ["--model", model]
        if "--device" in ctx.help_of("benchmarks/overhead.py"):
            cmd += ["--device", "cuda"]
        return cmd

    return command


def _doctor_perf(ctx: Context) -> list[str]:
    nproc = min(ctx.gpus, 8)
    return [ctx.python, "-m", "hpctrain", "doctor", "--perf", "--out", str(ctx.out / "doctor-perf")] + \
        (["--nproc-per-node", str(nproc)] if nproc > 1 else [])


def _first_gpu(ctx: Context) -> dict:
    visible = (ctx.env.get("cuda_visible_devices") or "0").split(",")[0] or "0"
    return {"CUDA_VISIBLE_DEVICES": visible}


SHARDING_NEEDS_2 = ("needs 2 GPUs: zero1 and fsdp shard over ranks, and NCCL refuses two ranks on one GPU; the "
                    "CPU runs (tests/dist/test_strategies.py, benchmarks/memory.py) cover the logic")


def _faceseg_decode(ctx: Context) -> list[str]:
    """benchmarks/faceseg_decode.py over the quick check's faces (the same --workdir and count: under --quick the
    shards faceseg-throughput made are reused; the full check's faceseg-throughput makes its own, so this stage
    generates them), the loader at 1 to 12 workers."""
    return [ctx.python, "benchmarks/faceseg_decode.py", "--faces", str(QUICK_FACES), "--workdir", _faces_dir(ctx),
            "--workers", "1", "2", "4", "8", "12", "--json", str(ctx.out / "faceseg-decode.json")]


STAGES: list[Stage] = [
    Stage("tests-gpu", lambda ctx: [ctx.python, "-m", "pytest", "tests/gpu", "-q", "-rA", "-p", "no:cacheprovider",
                                    f"--junitxml={ctx.out / 'tests-gpu.xml'}"],
          900, numbers=pytest_numbers),
    Stage("train-1proc", _train("train-1proc"), 300, numbers=train_numbers("train-1proc", "single/cuda")),
    # NCCL between two GPUs of the node (all visible to both ranks: cuda:LOCAL_RANK).
    Stage("train-2proc-nccl", _train("train-2proc-nccl", 2), 400,
          skip=needs_gpus(2, ONE_GPU_NCCL), numbers=train_numbers("train-2proc-nccl", "nccl/cuda")),
    # Two ranks that each see one GPU, the same one (as with srun --gpus-per-task=1 on a shared GPU): both bind
    # cuda:0. NCCL refuses two ranks on one GPU, so the data plane is gloo here, on CUDA tensors.
    Stage("train-2proc-shared-gpu", _train("train-2proc-shared-gpu", 2, "dist.backend=gloo"), 400,
          env=_first_gpu, numbers=train_numbers("train-2proc-shared-gpu", "gloo/cuda")),
    # FSDP2 over NCCL with bf16 gathers: the same demo under dist.strategy=fsdp, and then zero1.
    Stage("train-2proc-fsdp", _train("train-2proc-fsdp", 2, "dist.strategy=fsdp"), 400,
          skip=needs_gpus(2, SHARDING_NEEDS_2), numbers=train_numbers("train-2proc-fsdp", "nccl/cuda")),
    Stage("train-2proc-zero1", _train("train-2proc-zero1", 2, "dist.strategy=zero1"), 400,
          skip=needs_gpus(2, SHARDING_NEEDS_2), numbers=train_numbers("train-2proc-zero1", "nccl/cuda")),
    Stage("overhead-mlp", _overhead("mlp"), 600, skip=needs_option("benchmarks/overhead.py", "--device", OVERHEAD_CPU_ONLY),
          numbers=overhead_numbers),
    Stage("overhead-tiny", _overhead("tiny"), 600, skip=needs_option("benchmarks/overhead.py", "--device", OVERHEAD_CPU_ONLY),
          numbers=overhead_numbers),
    Stage("checkpoint-stall", lambda ctx: [ctx.python, "benchmarks/checkpoint.py", "--repeats", "3", "--device", "cuda",
                                           "--dir", str(ctx.out)], 600, numbers=checkpoint_numbers),
    Stage("doctor-perf", _doctor_perf, 300, numbers=preflight_numbers),
    Stage("vote", lambda ctx: [ctx.python, f"{ARCHIVE}/vote.py"], 300, numbers=table_numbers),
    Stage("compile-order", lambda ctx: [ctx.python, f"{ARCHIVE}/compile_order.py"], 600, numbers=table_numbers),
    Stage("memory-strategies", lambda ctx: [ctx.python, "benchmarks/memory.py", "--device", "cuda", "--worlds",
                                            ",".join(str(w) for w in (1, 2, 4) if w <= ctx.gpus)], 600,
          skip=needs_gpus(2, SHARDING_NEEDS_2), numbers=table_numbers),
    Stage("ddpm-throughput", lambda ctx: [ctx.python, "benchmarks/ddpm_throughput.py", "--device", "cuda", "--json",
                                          str(ctx.out / "ddpm-throughput.json")], 300, numbers=table_numbers),
    # Generates and shards 5,000 faces first (about a minute on 16 cores), then model-only and end-to-end rows.
    Stage("faceseg-throughput", lambda ctx: [ctx.python, "benchmarks/faceseg_throughput.py", "--device", "cuda",
                                             "--repeats", "3", "--json", str(ctx.out / "faceseg-throughput.json")],
          600, numbers=table_numbers),
    Stage("faceseg-decode", _faceseg_decode, 300, numbers=table_numbers),
]


QUICK_BUDGET_S = 480.0
"""--quick: everything, compilation included, within 8 minutes (a debug partition's allocation, less start-up)."""
QUICK_TESTS_S = 180.0
"""--quick: tests/gpu's share."""
QUICK_FACES = 2000
"""--quick: faces for the end-to-end rows (1,600 for training; 35 MB of shards at 256 px)."""


def _tests_parallel(ctx: Context) -> list[str]:
    """tests/gpu as four concurrent pytest processes: each of the two compile tests (CPU-bound tracing and Inductor,
    about a minute each) and the graphed-step tests (three launches) beside the rest, so that none adds to the
    others' time."""
    return [ctx.python, "tools/pytest_parallel.py", "--junit-prefix", str(ctx.out / "tests-gpu"), "--",
            "tests/gpu", "-k", "compiled_digits", ":::", "tests/gpu", "-k", "faceseg_from_shards", ":::",
            "tests/gpu/test_step_graphed.py", ":::",
            "tests/gpu", "--ignore=tests/gpu/test_step_graphed.py",
            "-k", "not compiled_digits and not faceseg_from_shards"]


def _faces_dir(ctx: Context) -> str:
    return ctx.faces_dir or str(ctx.out / "faces")


QUICK: list[Stage] = [
    Stage("tests-gpu", _tests_parallel, QUICK_TESTS_S, numbers=pytest_numbers),
    # Eager and graphed at the reference micro batch, twice it, and the reference global batch; short windows.
    Stage("ddpm-throughput", lambda ctx: [ctx.python, "benchmarks/ddpm_throughput.py", "--device", "cuda", "--micro",
                                          "64,128,384", "--steps", "20", "--warmup", "5", "--repeats", "3", "--modes",
                                          "eager,graphed", "--json", str(ctx.out / "ddpm-throughput.json")], 170,
          numbers=table_numbers),
    Stage("faceseg-throughput", lambda ctx: [ctx.python, "benchmarks/faceseg_throughput.py", "--device", "cuda",
                                             "--batches", "16", "32", "--steps", "15", "--warmup", "5", "--repeats",
                                             "3", "--no-compile", "--step-mode", "graphed", "--cudnn-benchmark",
                                             "--faces", str(QUICK_FACES),
                                             "--workdir",
                                             _faces_dir(ctx), "--json", str(ctx.out / "faceseg-throughput.json")],
          150, numbers=table_numbers),
    # The compiled model captured (the issue's goals' technique): about 80 s of compilation per batch size and loop
    # pair on an H100 node, so this one comes after the eager and graphed rows of both
    # experiments (the budget cuts it on a slow node).
    Stage("ddpm-throughput-compiled", lambda ctx: [ctx.python, "benchmarks/ddpm_throughput.py", "--device", "cuda",
                                                   "--micro", "64,384", "--steps", "20", "--warmup", "5", "--repeats",
                                                   "3", "--modes", "graphed-compiled", "--json",
                                                   str(ctx.out / "ddpm-throughput-compiled.json")], 300,
          numbers=table_numbers),
    # The node's CPU cores per GPU for the face-parsing data path (faceseg-throughput's faces, reused): CPU only,
    # about a minute; after the throughput rows, which are what the GPU is lent for.
    Stage("faceseg-decode", _faceseg_decode, 90, numbers=table_numbers),
    Stage("checkpoint-stall", lambda ctx: [ctx.python, "benchmarks/checkpoint.py", "--repeats", "2", "--device", "cuda",
                                           "--dir", str(ctx.out)], 90, numbers=checkpoint_numbers),
    Stage("doctor-perf", _doctor_perf, 60, numbers=preflight_numbers),
    Stage("train-2proc-shared-gpu", _train("train-2proc-shared-gpu", 2, "train.max_steps=60"), 60, env=_first_gpu,
          numbers=train_numbers("train-2proc-shared-gpu", "gloo/cuda")),
    Stage("train-2proc-nccl", _train("train-2proc-nccl", 2, "train.max_steps=60"), 60,
          skip=needs_gpus(2, ONE_GPU_NCCL), numbers=train_numbers("train-2proc-nccl", "nccl/cuda")),
]


# ---- running -------------------------------------------------------------------------------------------------

STAGE_GRACE_S = 10.0
"""A stage at its limit first gets SIGINT (pytest then prints its summary and writes its junit xml, a benchmark its
partial output), then this long before SIGKILL."""


class StopCheck(Exception):
    """SIGTERM or SIGINT to the check itself (a job's time limit): the running stage is stopped and recorded."""


def _stop_check(signum: int, _frame) -> None:
    raise StopCheck(signal.Signals(signum).name)


def _stop_stage(proc: subprocess.Popen) -> None:
    """SIGINT to the stage's session, a grace period, then SIGKILL to everything left: the tree as it was before the
    SIGINT too (a process that left its parent's session and outlived it is no longer below the stage)."""
    tree = descendants(proc.pid)
    try:
        os.killpg(proc.pid, signal.SIGINT)
        proc.wait(timeout=STAGE_GRACE_S)
    except (ProcessLookupError, PermissionError, subprocess.TimeoutExpired):
        pass
    for pid in tree:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    _kill_tree(proc)


def _kill_tree(proc: subprocess.Popen) -> None:
    kill_tree(proc.pid)
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # the stage's own session
    except (ProcessLookupError, PermissionError):
        pass
    proc.wait()


def run_stage(stage: Stage, ctx: Context, index: int, timeout_s: float) -> Result:
    log = ctx.out / f"{index:02d}-{stage.name}.log"
    started = time.perf_counter()
    try:
        cmd = stage.command(ctx)
        env = {**os.environ, "PYTHONUNBUFFERED": "1", **stage.env(ctx)}
    except Exception as err:  # a stage that cannot even be built fails alone
        return Result(stage.name, "fail", f"could not build the command: {err!r}", 0.0)
    extra = " ".join(f"{k}={v}" for k, v in stage.env(ctx).items())
    with open(log, "w") as f:
        f.write(f"{ctx.header}\n# stage {stage.name}: {extra + ' ' if extra else ''}{shlex.join(cmd)}\n"
                f"# timeout {timeout_s:g} s\n\n")
        f.flush()
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env, cwd=ROOT,
                                start_new_session=True)
        stopped = ""
        try:
            code = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            _stop_stage(proc)
            code = None
        except StopCheck as err:
            stopped = str(err)
            _stop_stage(proc)
            code = None
    seconds = time.perf_counter() - started
    output = log.read_text(errors="replace")
    try:
        numbers, problem = stage.numbers(ctx, output)
    except Exception as err:
        numbers, problem = "", f"could not read the results: {err!r}"
    if stopped:
        status, detail = "cut", f"the check was stopped by {stopped} after {seconds:.0f} s of this stage"
    elif code is None:
        status, detail = "fail", f"timed out after {timeout_s:g} s"
    elif code != 0:
        status, detail = "fail", f"exit code {code}"
    elif problem:
        status, detail = "fail", problem
    else:
        status, detail = "pass", ""
    text = "; ".join(x for x in (detail, numbers) if x)
    with open(log, "a") as f:
        f.write(f"\n# {stage.name}: {status.upper()} in {seconds:.1f} s{': ' + text if text else ''}\n")
    return Result(stage.name, status, text, seconds, str(log.relative_to(ctx.out)), shlex.join(cmd))


def run_stages(stages: list[Stage], ctx: Context, budget_s: float = float("inf"), echo=print,
               after: Callable[[list[Result]], None] = lambda results: None) -> list[Result]:
    """Every stage in order, each with its own timeout (cut to what is left of the budget); ``after`` is called with
    the results so far after each stage (to keep the summary and archive current)."""
    results, deadline = [], time.monotonic() + budget_s
    for index, stage in enumerate(stages, start=1):
        try:
            left = deadline - time.monotonic()
            reason = stage.skip(ctx)
            if reason:
                result = Result(stage.name, "skip", reason, 0.0)
            elif left < 30:
                # not run: the check is incomplete, which a green summary would hide
                result = Result(stage.name, "cut", f"not run: out of the time budget ({budget_s:g} s)", 0.0)
            else:
                limit = min(stage.timeout_s, left)
                echo(f"[gpu-check] {stage.name} (timeout {limit:.0f} s) ...", file=sys.stderr, flush=True)
                result = run_stage(stage, ctx, index, limit)
        except StopCheck as err:  # outside a stage's process (e.g. while asking whether to skip it)
            result = Result(stage.name, "cut", f"the check was stopped by {err} before this stage", 0.0)
        echo(f"[gpu-check] {stage.name}: {result.status.upper()} ({result.seconds:.1f} s) {result.numbers}",
             file=sys.stderr, flush=True)
        results.append(result)
        try:
            after(results)
        except Exception as err:  # a summary that cannot be written must not end the check
            echo(f"[gpu-check] could not write the summary or archive: {type(err).__name__}: {err}",
                 file=sys.stderr, flush=True)
        if result.status == "cut" and result.numbers.startswith("the check was stopped"):
            break
    return results


def run_stopping_cleanly(stages: list[Stage], ctx: Context, budget_s: float,
                         after: Callable[[list[Result]], None]) -> list[Result]:
    """run_stages, where SIGTERM or SIGINT to the check (a job's time limit, Ctrl-C) stops the running stage, records
    it as cut with its log, and ends the check after ``after`` has kept the results."""
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, _stop_check)
    try:
        return run_stages(stages, ctx, budget_s, after=after)
    finally:
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, signal.SIG_DFL)


def table(results: list[Result]) -> str:
    rows = [("stage", "status", "key numbers", "seconds")] + \
        [(r.stage, r.status.upper(), r.numbers, f"{r.seconds:.1f}") for r in results]
    widths = [max(len(row[i]) for row in rows) for i in range(4)]
    lines = [" | ".join(cell.ljust(widths[i]) if i < 3 else cell.rjust(widths[i]) for i, cell in enumerate(row))
             for row in rows]
    lines.insert(1, "-+-".join("-" * w for w in widths))
    return "\n".join(lines)


def markdown(results: list[Result], head: str) -> str:
    lines = [head, "", "| stage | status | key numbers | seconds | log |", "|---|---|---|---:|---|"]
    lines += [f"| {r.stage} | {r.status.upper()} | {r.numbers.replace('|', '/')} | {r.seconds:.1f} | {r.log} |"
              for r in results]
    return "\n".join(lines) + "\n"


def exit_code(results: list[Result]) -> int:
    return 1 if any(r.status in ("fail", "cut") for r in results) else 0


ARCHIVE = "results.tar.gz"


def write_summary(out: Path, env: dict, head: str, results: list[Result], seconds: float,
                  archives: list[Path]) -> None:
    """summary.json, summary.md and the archive(s) of the whole folder, each replaced atomically: a reader (or a
    job killed mid-write) finds the previous complete one or the new complete one."""
    summary = {"environment": env, "seconds": round(seconds, 1), "exit_code": exit_code(results),
               "stages": [asdict(r) for r in results]}
    _atomic_text(out / "summary.json", json.dumps(summary, indent=1) + "\n")
    _atomic_text(out / "summary.md", markdown(results, head))
    for path in archives:
        write_archive(out, path)


LEFT_OUT = ("checkpoints", "faces")
"""Folders the archive leaves out: the runs' checkpoints and the generated face set (megabytes each, no results)."""


def write_archive(folder: Path, path: Path) -> None:
    """folder as a gzipped tar (named after the folder inside), without archives of itself, checkpoints and the
    face set: the logs, reports, metrics and summaries, small enough to come back from any job."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    skip = {path.resolve(), tmp.resolve(), (folder / ARCHIVE).resolve()}

    def keep(info: tarfile.TarInfo) -> tarfile.TarInfo | None:
        parts = Path(info.name).parts[1:]
        if (folder.parent / info.name).resolve() in skip or info.name.endswith(".tmp") or \
                any(part in LEFT_OUT for part in parts):
            return None
        return info

    with tarfile.open(tmp, "w:gz", compresslevel=6) as tar:
        tar.add(folder, arcname=folder.name, filter=keep)
    os.replace(tmp, path)


def _atomic_text(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def default_out(env: dict) -> Path:
    return ROOT / "gpu-check-results" / f"{time.strftime('%Y%m%d-%H%M%S')}-{env.get('host', 'host')}"


def select(stages: list[Stage], only: str, skip: str) -> list[Stage]:
    names = {s.name for s in stages}
    wanted = [n for n in (only + "," + skip).split(",") if n]
    unknown = [n for n in wanted if n not in names]
    if unknown:
        raise SystemExit(f"unknown stage(s) {', '.join(unknown)}; stages: {', '.join(s.name for s in stages)}")
    keep = {n for n in only.split(",") if n} or names
    drop = {n for n in skip.split(",") if n}
    return [s for s in stages if s.name in keep and s.name not in drop]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help=f"the quick check: the stages of QUICK within "
                   f"{QUICK_BUDGET_S:g} s (a short allocation); see the module docstring")
    p.add_argument("--out", default="", help="results folder (default $GPU_CHECK_DIR, else "
                   "gpu-check-results/<date>-<host>)")
    p.add_argument("--only", default="", metavar="STAGE,...", help="run only these stages")
    p.add_argument("--skip", default="", metavar="STAGE,...", help="leave these stages out")
    p.add_argument("--budget-s", type=float, default=None, help="stop starting stages after this many seconds "
                   f"(each stage's timeout is cut to what is left; default 1200, with --quick {QUICK_BUDGET_S:g})")
    p.add_argument("--faces-dir", default="", metavar="DIR", help="a face set made beforehand (python "
                   "benchmarks/faceseg_throughput.py --prepare-only --faces 2000 --workdir DIR) for the face-parsing "
                   "end-to-end rows; default: generated into the results folder")
    p.add_argument("--archive", default="", metavar="PATH", help="also write the results archive here, after "
                   "every stage")
    p.add_argument("--list", action="store_true", help="list the stages and exit")
    p.add_argument("--print-environment", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.print_environment:
        print(json.dumps(collect_environment()))
        return 0
    table_of = QUICK if args.quick else STAGES
    budget = args.budget_s if args.budget_s is not None else (QUICK_BUDGET_S if args.quick else 1200.0)
    if args.list:
        for s in table_of:
            print(f"{s.name:24s} timeout {s.timeout_s:g} s")
        return 0
    stages = select(table_of, args.only, args.skip)
    started = time.perf_counter()
    env = query_environment(sys.executable)
    out = Path(args.out or os.environ.get("GPU_CHECK_DIR") or default_out(env)).resolve()
    out.mkdir(parents=True, exist_ok=True)
    ctx = Context(out, env, header=header(env), faces_dir=str(Path(args.faces_dir).resolve()) if args.faces_dir else "")
    (out / "environment.json").write_text(json.dumps(env, indent=1) + "\n")
    print(ctx.header, file=sys.stderr)
    if env.get("error"):
        print(f"[gpu-check] could not query torch/CUDA: {env['error']}", file=sys.stderr)
    device = f"{env.get('device')} x{env.get('gpu_count')}" if ctx.gpus else "no CUDA device"
    versions = f"{device}, torch {env.get('torch')}, CUDA {env.get('cuda') or '-'}, NCCL {env.get('nccl') or '-'}"
    env_result = Result("environment", "fail" if env.get("error") else "pass", env.get("error", "")[:200] or versions,
                        env["query_s"], "environment.json")
    archives = [out / ARCHIVE] + ([Path(args.archive).resolve()] if args.archive else [])

    def keep(results: list[Result]) -> None:
        write_summary(out, env, ctx.header, [env_result] + results, time.perf_counter() - started, archives)

    keep([])
    results = [env_result] + run_stopping_cleanly(stages, ctx, budget - (time.perf_counter() - started), keep)
    total = time.perf_counter() - started
    write_summary(out, env, ctx.header, results, total, archives)
    print(f"\n{ctx.header}\n\n{table(results)}\n\n{len(results)} stages in {total:.0f} s: "
          f"{sum(r.status == 'pass' for r in results)} passed, {sum(r.status == 'fail' for r in results)} failed, "
          f"{sum(r.status == 'skip' for r in results)} skipped, {sum(r.status == 'cut' for r in results)} cut by "
          f"the time budget; results in {out}")
    return exit_code(results)


if __name__ == "__main__":
    sys.exit(main())
