"""hpctrain's exit path (process_exit): no abort from torch's threads at interpreter exit, and nothing a normal exit
does for the outside world is skipped (threads joined, atexit handlers run, open files flushed, exit status kept)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ABORT = "terminate called without an active exception"

# Two daemon threads inside torch operators while the main thread ends: the shape of pytorch/pytorch#38228 (and of
# a gloo worker finishing an async collective at exit, #190489). On torch 2.14 with CPython 3.11, a plain exit
# aborts nearly every time.
BUSY_TORCH_THREADS = """
import threading, time, torch
def busy():
    a = torch.randn(600, 600)
    while True:
        a @ a
for _ in range(2):
    threading.Thread(target=busy, daemon=True).start()
time.sleep(0.3)
"""


def run_script(tmp_path: Path, body: str) -> subprocess.CompletedProcess:
    script = tmp_path / "script.py"
    script.write_text(textwrap.dedent(body))
    # Without PYTHONUNBUFFERED, which also makes libc's stdio unbuffered (and so would hide a missing C flush).
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}
    return subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120, cwd=tmp_path,
                          env=env)


def test_torch_threads_running_at_exit_abort_a_plain_exit_but_not_hpctrains(tmp_path: Path):
    """The same program twice: a plain exit (the control, retried until it shows the bug, which is a race) and
    hpctrain's exit path, three times, each with the exit status and output it asked for."""
    for _ in range(5):
        control = subprocess.run([sys.executable, "-c", BUSY_TORCH_THREADS + "\nraise SystemExit(3)"],
                                 capture_output=True, text=True, timeout=120)
        if control.returncode == -6:
            assert ABORT in control.stderr
            break
    else:
        pytest.skip(f"a plain exit with torch threads running did not abort in 5 tries (last exit "
                    f"{control.returncode}): pytorch#38228 may be fixed in this torch; process_exit can be reconsidered")
    for _ in range(3):
        result = run_script(tmp_path, f"""
            from hpctrain.process_exit import run_and_exit
            def main():
                {BUSY_TORCH_THREADS.strip().replace(chr(10), chr(10) + ' ' * 16)}
                print("finished", flush=True)
                return 3
            run_and_exit(main)
        """)
        assert ABORT not in result.stderr, result.stderr
        assert (result.returncode, result.stdout) == (3, "finished\n"), result.stderr


def test_c_level_output_a_library_did_not_flush_is_written(tmp_path: Path):
    """printf into a pipe or a Slurm log file is fully buffered by libc; os._exit alone would drop it."""
    result = run_script(tmp_path, r"""
        import ctypes
        from hpctrain.process_exit import run_and_exit
        def main():
            ctypes.CDLL(None).printf(b"from C, unflushed\n")
            return 0
        run_and_exit(main)
    """)
    assert (result.returncode, result.stdout) == (0, "from C, unflushed\n"), result.stderr


def test_an_interrupt_ends_the_process_by_sigint_and_a_broken_file_does_not_change_the_status(tmp_path: Path):
    interrupted = run_script(tmp_path, """
        from hpctrain.process_exit import run_and_exit
        def main():
            raise KeyboardInterrupt
        run_and_exit(main)
    """)
    assert interrupted.returncode == -2 and "KeyboardInterrupt" in interrupted.stderr
    broken = run_script(tmp_path, """
        import io
        from hpctrain.process_exit import run_and_exit
        class Odd(io.RawIOBase):
            @property
            def closed(self):
                raise AttributeError("half-built")
        def main():
            globals()["odd"] = Odd.__new__(Odd)
            return 4
        run_and_exit(main)
    """)
    assert broken.returncode == 4, broken.stderr


def test_a_normal_exit_is_kept_threads_atexit_files_and_status(tmp_path: Path):
    result = run_script(tmp_path, """
        import atexit, threading, time
        from hpctrain.process_exit import run_and_exit
        def main():
            unclosed = open("buffered.txt", "w")  # never closed: a finalizing interpreter would flush it
            unclosed.write("kept")
            atexit.register(lambda: open("atexit.txt", "w").write("ran"))
            def slow_writer():
                time.sleep(0.5)
                with open("thread.txt", "w") as f:
                    f.write("finished")
            threading.Thread(target=slow_writer).start()  # not a daemon: the exit waits for it
            globals()["keep"] = unclosed
            return 0
        run_and_exit(main)
    """)
    assert result.returncode == 0, result.stderr
    assert {name: (tmp_path / name).read_text() for name in ("buffered.txt", "atexit.txt", "thread.txt")} == \
        {"buffered.txt": "kept", "atexit.txt": "ran", "thread.txt": "finished"}


@pytest.mark.parametrize(("body", "code", "stderr"), [
    ("raise SystemExit('bad input')", 1, "bad input"),
    ("raise SystemExit(None)", 0, ""),
    ("raise SystemExit(258)", 2, ""),
    ("raise ValueError('boom')", 1, "ValueError: boom"),
    ("return None", 0, ""),
])
def test_exit_status_as_python_gives_it(tmp_path: Path, body: str, code: int, stderr: str):
    result = run_script(tmp_path, f"""
        from hpctrain.process_exit import run_and_exit
        def main():
            {body}
        run_and_exit(main)
    """)
    assert result.returncode == code, result.stderr
    assert stderr in result.stderr
    if "ValueError" in stderr:
        assert "Traceback (most recent call last)" in result.stderr


def test_the_hpctrain_program_exits_through_it():
    """Both ways in (console script, python -m) and the launcher's and srun task's modules end through it."""
    import tomllib

    root = Path(__file__).resolve().parents[2]
    scripts = tomllib.loads((root / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts["hpctrain"] == "hpctrain.cli:entry_point"
    for module in ("__main__.py", "launch.py", "srun_task.py"):
        assert "run_and_exit" in (root / "src" / "hpctrain" / module).read_text() or \
            "entry_point" in (root / "src" / "hpctrain" / module).read_text(), module
