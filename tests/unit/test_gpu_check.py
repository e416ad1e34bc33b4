"""`make gpu-check` (tools/gpu_check.py): the CPU path (every GPU stage skipped, exit 0, the table and
environment.json) and the stage runner (a failing and a timed-out stage fail alone, the others still run)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import tool_module

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "tools" / "gpu_check.py"


@pytest.fixture(scope="module")
def gc():
    with tool_module("gpu_check") as module:
        yield module


def test_without_cuda_every_gpu_stage_is_skipped_and_the_command_succeeds(tmp_path: Path, gc):
    out = tmp_path / "results"
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}  # no CUDA device, also on a GPU machine
    env.pop("GPU_CHECK_DIR", None)
    started = time.monotonic()
    done = subprocess.run([sys.executable, str(SCRIPT), "--out", str(out)], capture_output=True, text=True, env=env,
                          cwd=tmp_path, timeout=240)
    assert done.returncode == 0, done.stdout + done.stderr
    assert time.monotonic() - started < 120
    assert "stage" in done.stdout and "status" in done.stdout and "key numbers" in done.stdout
    assert "# hpctrain gpu-check |" in done.stdout and "no CUDA device" in done.stdout
    lines = {line.split("|")[0].strip(): line for line in done.stdout.splitlines() if "|" in line}
    for stage in gc.STAGES:
        assert "SKIP" in lines[stage.name], lines.get(stage.name)
    assert "no CUDA device: skipped; run on a GPU node" in lines["tests-gpu"]

    environment = json.loads((out / "environment.json").read_text())
    assert environment["gpu_count"] == 0 and environment["device"] == "cpu" and environment["cuda"] is None
    assert environment["torch"] and environment["date"] and environment["host"] and "nccl" in environment
    summary = json.loads((out / "summary.json").read_text())
    assert summary["exit_code"] == 0 and summary["environment"]["torch"] == environment["torch"]
    statuses = {s["stage"]: (s["status"], s["numbers"]) for s in summary["stages"]}
    assert statuses.pop("environment")[0] == "pass"
    assert set(statuses) == {s.name for s in gc.STAGES}
    for name, (status, reason) in statuses.items():
        assert status == "skip"
        assert reason == gc.NO_CUDA or reason.endswith("not present: skipped"), (name, reason)
    assert (out / "summary.md").read_text().startswith("# hpctrain gpu-check |")
    assert not list(out.glob("*.log"))  # nothing ran


def _py(code: str) -> object:
    return lambda ctx: [sys.executable, "-c", code]


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def test_a_failing_or_hung_stage_fails_alone_and_the_others_run(tmp_path: Path, gc):
    ctx = gc.Context(tmp_path, {"gpu_count": 1}, header="# hpctrain gpu-check | the header")
    grandchild = tmp_path / "grandchild.pid"
    hang = (f"import subprocess, sys, time\n"
            f"p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)'], start_new_session=True)\n"
            f"open({str(grandchild)!r}, 'w').write(str(p.pid))\n"
            f"time.sleep(120)\n")
    stages = [
        gc.Stage("fails", _py("print('boom'); raise SystemExit(3)"), 60),
        gc.Stage("hangs", _py(hang), 3),
        gc.Stage("wrong-numbers", _py("print('done')"), 60, numbers=lambda ctx, out: ("x 1", "x below the goal")),
        gc.Stage("not-here", _py("raise SystemExit(1)"), 60, skip=lambda ctx: "needs something else"),
        gc.Stage("passes", _py("print('| hpctrain | 1.25 [1.00, 1.50] | 0.970 |')"), 60, numbers=gc.table_numbers),
    ]
    results = gc.run_stages(stages, ctx, echo=lambda *a, **k: None)
    by = {r.stage: r for r in results}
    assert [r.stage for r in results] == [s.name for s in stages]
    assert by["fails"].status == "fail" and "exit code 3" in by["fails"].numbers
    assert by["hangs"].status == "fail" and "timed out after 3 s" in by["hangs"].numbers
    assert by["hangs"].seconds < 30
    assert by["wrong-numbers"].status == "fail" and by["wrong-numbers"].numbers == "x below the goal; x 1"
    assert by["not-here"].status == "skip" and by["not-here"].numbers == "needs something else"
    assert by["passes"].status == "pass" and by["passes"].numbers == "hpctrain 1.25 (0.970)"
    assert gc.exit_code(results) == 1 and gc.exit_code([by["passes"], by["not-here"]]) == 0

    pid = int(grandchild.read_text())  # in a session of its own, like torchrun's workers: killed too
    deadline = time.monotonic() + 10
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(pid)
    log = (tmp_path / by["fails"].log).read_text()
    assert log.startswith("# hpctrain gpu-check | the header\n# stage fails:") and "boom" in log
    assert "FAIL" in log.splitlines()[-1]
    text = gc.table(results)
    assert text.splitlines()[0].split("|")[0].strip() == "stage" and "timed out" in text


def test_time_budget_and_stage_selection(tmp_path: Path, gc):
    ctx = gc.Context(tmp_path, {"gpu_count": 1}, header="# h")
    results = gc.run_stages([gc.Stage("late", _py("pass"), 60)], ctx, budget_s=0, echo=lambda *a, **k: None)
    assert results[0].status == "cut" and "time budget" in results[0].numbers
    assert gc.exit_code(results) == 1  # an incomplete check is not a green one
    names = [s.name for s in gc.select(gc.STAGES, "tests-gpu,doctor-perf", "doctor-perf")]
    assert names == ["tests-gpu"]
    with pytest.raises(SystemExit, match="unknown stage"):
        gc.select(gc.STAGES, "no-such-stage", "")


def test_key_numbers_from_the_stages_reports(tmp_path: Path, gc):
    ctx = gc.Context(tmp_path, {"gpu_count": 1})
    out = ("| mode | stall per save | save to complete on disk | training step during the write |\n"
           "|---|---:|---:|---:|\n"
           "| sync | 1,930 [1,789, 2,239] | 1,930 [1,789, 2,239] | 794 [756, 941] |\n"
           "| async | 77 [66, 266] | 3,489 [3,271, 3,912] | 880 [832, 915] |\n\n"
           "async stall / sync stall: 0.040 (goal <= 0.1)\n"
           "resume (pick, verify sha256, load, ready for the first step): 723 [709, 1,098] ms\n")
    assert gc.checkpoint_numbers(ctx, out) == (
        "stall sync 1,930 ms, async 77 ms, ratio 0.040 (goal <= 0.1), resume 723 ms", "")
    (tmp_path / "doctor-perf").mkdir()
    report = {"tflops_per_rank": [612.3], "dtype": "bfloat16", "world_size": 1, "bandwidth": [],
              "peak": {"gpu": "H100 SXM", "tflops": 989.0, "fraction": 0.619},
              "checks": [{"name": "matrix multiply", "status": "pass"}]}
    (tmp_path / "doctor-perf" / "preflight.json").write_text(json.dumps(report))
    numbers, problem = gc.preflight_numbers(ctx, "")
    assert numbers == "612.3 bfloat16 TFLOP/s (slowest rank), 62% of H100 SXM peak 989, busbw: 1 rank, not measured"
    assert problem == ""
    summary = "3 passed, 1 skipped in 80.1s"
    assert gc.pytest_numbers(ctx, f"...\n==== {summary} ====\n") == (summary, "")


def test_the_quick_check_is_ordered_by_value_and_fits_its_budget(gc):
    """Correctness first (tests/gpu within 3 minutes), then the two reference experiments' throughput, then the rest;
    the whole within 8 minutes on one H100."""
    names = [s.name for s in gc.QUICK]
    assert names[:4] == ["tests-gpu", "ddpm-throughput", "faceseg-throughput", "ddpm-throughput-compiled"]
    assert gc.QUICK_BUDGET_S <= 480 and gc.QUICK[0].timeout_s <= 180
    ctx = gc.Context(Path("/r"), {"gpu_count": 1}, python="py", faces_dir="/carried/faces")
    tests = gc.QUICK[0].command(ctx)
    assert tests[:2] == ["py", "tools/pytest_parallel.py"] and tests.count("tests/gpu") == 3
    faces = gc.QUICK[2].command(ctx)
    assert faces[faces.index("--workdir") + 1] == "/carried/faces" and faces[faces.index("--faces") + 1] == "2000"
    generated = gc.QUICK[2].command(gc.Context(Path("/r"), {"gpu_count": 1}, python="py"))
    assert generated[generated.index("--workdir") + 1] == "/r/faces"
    decode = next(s for s in gc.QUICK if s.name == "faceseg-decode").command(ctx)  # the same faces, not new ones
    assert decode[decode.index("--workdir") + 1] == "/carried/faces" and decode[decode.index("--faces") + 1] == "2000"


def test_the_quick_check_without_cuda_skips_and_leaves_its_archive(tmp_path: Path, gc):
    import tarfile

    out, extra = tmp_path / "results", tmp_path / "back" / "check.tar.gz"
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    done = subprocess.run([sys.executable, str(SCRIPT), "--quick", "--out", str(out), "--archive", str(extra)],
                          capture_output=True, text=True, env=env, cwd=tmp_path, timeout=240)
    assert done.returncode == 0, done.stdout + done.stderr
    for stage in gc.QUICK:
        assert any(line.startswith(stage.name) and "SKIP" in line for line in done.stdout.splitlines()), stage.name
    for archive in (out / gc.ARCHIVE, extra):
        with tarfile.open(archive) as tar:
            names = set(tar.getnames())
        assert {"results/summary.json", "results/summary.md", "results/environment.json"} <= names, names
        assert not any(n.endswith(gc.ARCHIVE) for n in names)


def test_the_archive_is_refreshed_after_every_stage_and_leaves_out_bulk(tmp_path: Path, gc):
    """A check killed at its allocation's limit still returns what it measured: when the second stage runs, the
    archive already holds the first stage's log and a summary that lists it. Checkpoints and faces stay out."""
    out = tmp_path / "results"
    (out / "run" / "checkpoints").mkdir(parents=True)
    (out / "run" / "checkpoints" / "big.bin").write_bytes(b"x" * 1000)
    (out / "faces").mkdir()
    (out / "faces" / "shard.tar").write_bytes(b"y")
    (out / "run" / "metrics.jsonl").write_text("{}\n")
    ctx = gc.Context(out, {"gpu_count": 1}, header="# h")
    check = ("import json, sys, tarfile\n"
             f"tar = tarfile.open({str(out / gc.ARCHIVE)!r})\n"
             "names = set(tar.getnames())\n"
             "summary = json.load(tar.extractfile('results/summary.json'))\n"
             "ok = 'results/01-first.log' in names and [s['stage'] for s in summary['stages']] == ['first']\n"
             "ok = ok and 'results/run/metrics.jsonl' in names and not any('checkpoints' in n or 'faces' in n for n in names)\n"
             "sys.exit(0 if ok else 3)\n")
    stages = [gc.Stage("first", _py("print('measured 42')"), 60), gc.Stage("second", _py(check), 60)]

    def keep(results):
        gc.write_summary(out, {}, "# h", results, 1.0, [out / gc.ARCHIVE])

    results = gc.run_stages(stages, ctx, echo=lambda *a, **k: None, after=keep)
    assert [r.status for r in results] == ["pass", "pass"], results


def test_pytest_parallel_runs_groups_together_and_sums_them(tmp_path: Path):
    with tool_module("pytest_parallel") as pp:
        assert pp.groups_of(["a", "-k", "x", ":::", "b", ":::"]) == [["a", "-k", "x"], ["b"]]
        assert pp.counts("..\n==== 3 passed, 1 failed, 2 skipped, 1 error in 4.1s ====\n") == {
            "passed": 3, "failed": 1, "skipped": 2, "errors": 1}
        assert pp.summary([{"passed": 3}, {"passed": 1, "failed": 1}], 2.0) == \
            "4 passed, 1 failed, 0 skipped, 0 errors in 2.0 s (2 groups)"
    (tmp_path / "test_a.py").write_text("import time\ndef test_slow_a():\n    time.sleep(1.5)\n")
    (tmp_path / "test_b.py").write_text("import time\ndef test_slow_b():\n    time.sleep(1.5)\n"
                                        "def test_fails():\n    assert False\n")
    done = subprocess.run([sys.executable, str(ROOT / "tools" / "pytest_parallel.py"), "--",
                           str(tmp_path / "test_a.py"), ":::", str(tmp_path / "test_b.py")],
                          capture_output=True, text=True, cwd=tmp_path, timeout=120)
    assert done.returncode == 1, done.stdout + done.stderr  # a failing group fails the whole
    assert done.stdout.splitlines()[-1].startswith("2 passed, 1 failed, 0 skipped, 0 errors in")


def test_a_check_ended_by_sigterm_keeps_the_running_stages_log_in_its_archive(tmp_path: Path):
    """A job's time limit sends SIGTERM: the running stage gets SIGINT (pytest then writes its summary), is recorded
    as cut with what it printed, the summary and archive are rewritten, and no later stage starts."""
    import signal
    import tarfile

    out = tmp_path / "results"
    out.mkdir()
    child = (
        "import sys, time\n"
        f"sys.path.insert(0, {str(ROOT / 'tools')!r})\n"
        "import gpu_check as gc\n"
        "from pathlib import Path\n"
        f"out = Path({str(out)!r})\n"
        "ctx = gc.Context(out, {'gpu_count': 1}, header='# h')\n"
        "work = 'import time; print(\"measured 42\", flush=True); time.sleep(60)'\n"
        "stages = [gc.Stage('first', lambda c: [sys.executable, '-c', 'print(1)'], 30),\n"
        "          gc.Stage('long', lambda c: [sys.executable, '-c', work], 120),\n"
        "          gc.Stage('never', lambda c: [sys.executable, '-c', 'print(2)'], 30)]\n"
        "keep = lambda r: gc.write_summary(out, {}, '# h', r, 1.0, [out / gc.ARCHIVE])\n"
        "results = gc.run_stopping_cleanly(stages, ctx, 600, keep)\n"
        "print('STATUSES', [(r.stage, r.status) for r in results], flush=True)\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", child], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, cwd=ROOT)
    try:
        deadline = time.monotonic() + 60
        log = out / "02-long.log"
        while time.monotonic() < deadline and not (log.exists() and "measured 42" in log.read_text()):
            time.sleep(0.2)
        proc.send_signal(signal.SIGTERM)
        output, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert "STATUSES [('first', 'pass'), ('long', 'cut')]" in output, output
    with tarfile.open(out / "results.tar.gz") as tar:
        summary = json.load(tar.extractfile("results/summary.json"))
        stage_log = tar.extractfile("results/02-long.log").read().decode()
    assert [s["status"] for s in summary["stages"]] == ["pass", "cut"]
    assert "stopped by SIGTERM" in summary["stages"][1]["numbers"] and "measured 42" in stage_log
