"""`hpctrain slurm submit` refuses before sbatch what would fail on the nodes after the queue wait: a run dir with a
queued or running job or a live training in it, a checkpoint the config cannot resume. `slurm logs --follow` ends
with the job; the commands it prints for pasting are shell-quoted. Slurm's commands are stand-ins on PATH."""

from __future__ import annotations

import dataclasses
import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from hpctrain.checkpoint.manager import Checkpointer
from hpctrain.cli import main
from hpctrain.dist.runtime import single_process_runtime
from hpctrain.fault import run_lock
from hpctrain.commands import slurm as commands
from hpctrain.slurm import job
from hpctrain.slurm.progress import latest_step
from hpctrain.train.state import TrainState


@pytest.fixture
def slurm(tmp_path, monkeypatch):
    """Stand-in sbatch (records that it ran, answers job 4242) and scontrol (answers JobState=<state>, the state
    read from a file the test writes; while a file 'append' exists, the call appends it to the log at 'log-path'
    and answers RUNNING, as a job that still writes would). State INVALID: Slurm's answer for a job it forgot;
    TIMEOUT: a controller that did not answer (while a file 'timeouts' holds a number, that many calls time out)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    calls = tmp_path / "sbatch-calls"
    state = tmp_path / "state"
    state.write_text("RUNNING")
    (bin_dir / "sbatch").write_text(f"#!/bin/sh\necho \"$@\" >> {calls}\necho '4242;cluster'\n")
    (bin_dir / "scontrol").write_text(
        "#!/bin/sh\n"
        f"now=$(head -n1 {state})\n"
        f"if [ -f {tmp_path}/append ]; then cat {tmp_path}/append >> \"$(cat {tmp_path}/log-path)\"; "
        f"rm {tmp_path}/append; now=RUNNING; fi\n"
        f"n=$(cat {tmp_path}/timeouts 2>/dev/null || echo 0)\n"
        f"if [ \"$n\" -gt 0 ]; then echo $((n - 1)) > {tmp_path}/timeouts; now=TIMEOUT; fi\n"
        "case \"$now\" in\n"
        "  INVALID) echo 'slurm_load_jobs error: Invalid job id specified' >&2; exit 1;;\n"
        "  TIMEOUT) echo 'slurm_load_jobs error: Socket timed out on send/recv operation' >&2; exit 1;;\n"
        "esac\n"
        f"echo \"JobId=$4 JobName=x JobState=$now Reason=None\"\n")
    for name in ("sbatch", "scontrol"):
        (bin_dir / name).chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    return dataclasses.make_dataclass("Slurm", ["calls", "state", "root"])(calls, state, tmp_path)


def submit(run: Path, *extra: str) -> int:
    return main(["slurm", "submit", "digits", f"run.dir={run}", "slurm.time=60", "ckpt.every_minutes=20", *extra])


def record_job(run: Path, job_id: str) -> None:
    (run / "slurm").mkdir(parents=True, exist_ok=True)
    with open(run / job.JOBS_FILE, "a") as f:
        f.write(json.dumps({"job_id": job_id}) + "\n")


def test_a_run_dir_with_a_running_job_is_refused_before_sbatch(tmp_path, slurm, capsys):
    run = tmp_path / "run"
    record_job(run, "4100")
    assert submit(run) == 2
    err = capsys.readouterr().err
    assert "already has job 4100 (RUNNING)" in err and "hpctrain slurm cancel 4100" in err
    assert not slurm.calls.exists()  # sbatch never ran
    slurm.state.write_text("PENDING")
    assert submit(run) == 2 and "job 4100 (PENDING)" in capsys.readouterr().err
    slurm.state.write_text("COMPLETED")  # ended: the run dir is free again
    assert submit(run) == 0 and slurm.calls.exists()


def test_a_run_dir_a_live_training_holds_is_refused_before_sbatch(tmp_path, slurm, capsys):
    run = tmp_path / "run"
    holder = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    try:
        me = run_lock.this_process()
        owner = run_lock.Owner(me.host, holder.pid, run_lock.process_start(holder.pid), since=1.0, beat=1.0)
        run.mkdir()
        (run / run_lock.LOCK_FILE).write_text(json.dumps(dataclasses.asdict(owner)))
        assert submit(run) == 2
    finally:
        holder.kill()
        holder.wait()
    assert f"in use by a running training: {run} (pid {holder.pid} on {me.host}" in capsys.readouterr().err
    assert not slurm.calls.exists()
    assert submit(run) == 0  # its holder is gone: the stale lock does not block


def save_checkpoint(run: Path, experiment: str, global_batch: int, config_text: str = "",
                    model: nn.Module | None = None) -> None:
    model = model or nn.Linear(2, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    stateful = {"model": model, "optimizer": optimizer, "scaler": torch.amp.GradScaler("cpu", enabled=False),
                "scheduler": torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0), "ema": None}
    state = TrainState(step=20, epoch=1, step_in_epoch=6, samples_seen=800, global_batch_size=global_batch)
    Checkpointer(run, experiment, single_process_runtime(torch.device("cpu")), config_text, 3).save(
        state.to_dict(), stateful, {"python": None})


@pytest.mark.parametrize("experiment, batch, says", [
    ("digits", 40, "was saved with 40"), ("toy", 100, "was written by experiment 'toy'")])
def test_a_checkpoint_the_config_cannot_resume_is_refused_before_sbatch(tmp_path, slurm, capsys, experiment, batch,
                                                                        says):
    run = tmp_path / "run"
    save_checkpoint(run, experiment, batch)
    assert submit(run, "train.global_batch_size=100") == 2
    assert says in capsys.readouterr().err
    assert not slurm.calls.exists()


def test_printed_commands_are_shell_quoted(tmp_path, slurm, capsys):
    run = tmp_path / "my runs" / "it's here"
    assert submit(run) == 0
    err = capsys.readouterr().err
    status = next(line.strip() for line in err.splitlines() if "slurm status" in line)
    assert shlex.split(status) == ["hpctrain", "slurm", "status", str(run)]
    logs = next(line.strip() for line in err.splitlines() if "slurm logs" in line)
    assert shlex.split(logs) == ["hpctrain", "slurm", "logs", str(run), "--follow"]


def test_logs_follow_ends_when_the_job_has_ended(tmp_path, slurm, capsys, monkeypatch):
    """tail -F never ended. The job writes one more line, then ends: the line is shown, and the command returns."""
    monkeypatch.setattr(os, "execvp", lambda *a: pytest.fail("replaced itself by tail, which never ends"))
    monkeypatch.setattr(commands, "FOLLOW_POLL_S", 0.01, raising=False)
    monkeypatch.setattr(commands, "FOLLOW_STATE_S", 0.0, raising=False)
    run = tmp_path / "run"
    record_job(run, "4100")
    (run / "logs").mkdir()
    log = run / "logs" / "digits_4100.out"
    log.write_text("".join(f"line {i}\n" for i in range(30)))
    (slurm.root / "log-path").write_text(str(log))
    (slurm.root / "append").write_text("step 7 done\n")  # written during the first scontrol call
    slurm.state.write_text("COMPLETED")
    assert main(["slurm", "logs", str(run), "-n", "5", "--follow"]) == 0
    captured = capsys.readouterr()
    assert captured.out.splitlines() == [f"line {i}" for i in range(25, 30)] + ["step 7 done"]
    assert "job 4100 has ended (COMPLETED)" in captured.err


def test_a_sweep_point_that_a_live_training_holds_is_refused_before_sbatch(tmp_path, slurm, capsys):
    """`sweep submit --local` (or a plain train) runs a point here: an array must not train it again at once."""
    from hpctrain.sweep.spec import build_sweep

    args = ("train.max_steps=4", "slurm.time=60", "ckpt.every_minutes=20")
    plan, configs = build_sweep("digits", None, args, ["optim.lr=0.1,0.2"], str(tmp_path / "s"))
    point = Path(configs[plan.points[1].name].run_dir)
    holder = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    try:
        me = run_lock.this_process()
        owner = run_lock.Owner(me.host, holder.pid, run_lock.process_start(holder.pid), since=1.0, beat=1.0)
        point.mkdir(parents=True)
        (point / run_lock.LOCK_FILE).write_text(json.dumps(dataclasses.asdict(owner)))
        code = main(["sweep", "submit", "digits", "--grid", "optim.lr=0.1,0.2", "--dir", str(tmp_path / "s"), *args])
    finally:
        holder.kill()
        holder.wait()
    assert code == 2
    assert f"in use by a running training: {point} (pid {holder.pid}" in capsys.readouterr().err
    assert not slurm.calls.exists()


def digits_checkpoint(run: Path, *overrides: str) -> None:
    """A checkpoint of the digits model built with these [model] settings, and their config.toml."""
    from hpctrain.config import config_to_toml
    from hpctrain.resolution import resolve_config as resolve

    cls, saved = resolve("digits", None, (f"run.dir={run}", *overrides))
    save_checkpoint(run, "digits", saved.train.global_batch_size, config_to_toml(saved), cls(saved).build_model())


@pytest.mark.parametrize("saved, says", [
    ("model.width=8", "shape of"),            # every conv and the head change shape
    ("model.norm=group", "not in the checkpoint")])  # GroupNorm has no running statistics: names differ
def test_a_model_the_checkpoint_does_not_fit_is_refused_force_or_not(tmp_path, slurm, capsys, saved, says):
    """Local train refuses such a resume at its strict load; the job would fail there on every rank after its queue
    wait. --force does not pass it: it would fail for sure."""
    run = tmp_path / "run"
    digits_checkpoint(run, saved)
    for extra in ((), ("--force",)):
        assert submit(run, *extra) == 2
        err = capsys.readouterr().err
        assert "does not fit this model" in err and says in err and saved.split("=")[0] in err, err
    assert not slurm.calls.exists()
    slurm.state.write_text("COMPLETED")  # each submit below records a job: ended at once
    assert submit(run, saved) == 0  # the run's own settings: nothing to say
    assert "model." not in capsys.readouterr().err


def test_a_model_setting_that_changes_no_parameter_is_a_warning_as_local_train_resumes_it(tmp_path, slurm, capsys):
    """model.max_shift (augmentation) changes no parameter: local train resumes with it, so submit does too, and
    says which key differs."""
    run = tmp_path / "run"
    digits_checkpoint(run, "model.max_shift=2")
    slurm.state.write_text("COMPLETED")
    assert submit(run) == 0
    err = capsys.readouterr().err
    assert "WARNING model: model.max_shift is 1 here but 2 in" in err and "unchanged" in err, err
    assert slurm.calls.exists()


def test_a_slurm_controller_that_does_not_answer_is_not_a_free_run_dir(tmp_path, slurm, capsys):
    """'Socket timed out' says nothing about the run dir's job: refused (it may still run), --force submits."""
    run = tmp_path / "run"
    record_job(run, "4100")
    slurm.state.write_text("TIMEOUT")
    assert submit(run) == 2
    err = capsys.readouterr().err
    assert "could not ask Slurm whether a job of run dir" in err and "Socket timed out" in err and "--force" in err
    assert not slurm.calls.exists()
    assert submit(run, "--force") == 0 and slurm.calls.exists()
    assert "submitting anyway (--force)" in capsys.readouterr().err
    slurm.state.write_text("INVALID")  # forgotten by Slurm: ended long ago
    assert submit(run) == 0


@pytest.mark.parametrize("state", ["COMPLETED", "CANCELLED", "INVALID"])
def test_a_lock_whose_slurm_job_has_ended_does_not_block_a_submit(tmp_path, slurm, capsys, state):
    """Rank 0 SIGKILLed at the end of KillWait (a long final save) leaves run.lock with a fresh heartbeat on another
    node: Slurm says its job has ended, so the run dir is free, for submit as for the job's own start."""
    run = tmp_path / "run"
    run.mkdir()
    now = __import__("time").time()
    owner = run_lock.Owner("node7", 4711, "", job_id="4100", since=now - 600, beat=now)
    (run / run_lock.LOCK_FILE).write_text(json.dumps(dataclasses.asdict(owner)))
    slurm.state.write_text("RUNNING")
    assert submit(run) == 2 and "pid 4711 on node7, Slurm job 4100" in capsys.readouterr().err
    slurm.state.write_text(state)
    assert submit(run) == 0 and slurm.calls.exists()


def test_logs_follow_goes_on_when_slurm_does_not_answer(tmp_path, slurm, capsys, monkeypatch):
    """A controller timeout while following is no reason to stop (nor an error): it asks again, and ends when the
    job has."""
    monkeypatch.setattr(commands, "FOLLOW_POLL_S", 0.01, raising=False)
    monkeypatch.setattr(commands, "FOLLOW_STATE_S", 0.0, raising=False)
    run = tmp_path / "run"
    record_job(run, "4100")
    (run / "logs").mkdir()
    (run / "logs" / "digits_4100.out").write_text("line 0\n")
    (slurm.root / "timeouts").write_text("2")
    slurm.state.write_text("COMPLETED")
    assert main(["slurm", "logs", str(run), "--follow"]) == 0
    err = capsys.readouterr().err
    assert "Socket timed out" in err and "still following" in err and "job 4100 has ended (COMPLETED)" in err
    assert (slurm.root / "timeouts").read_text().strip() == "0"


def test_status_shows_the_step_of_a_stop_not_the_last_train_record(tmp_path, slurm, capsys):
    """A stop writes no train record (windows stay aligned): its stop record, and a resume's, carry the step."""

    run = tmp_path / "run"
    record_job(run, "4100")
    records = [{"step": 10, "split": "train", "epoch": 0, "loss": 0.5},
               {"step": 14, "split": "stop", "epoch": 0, "signal": "SIGUSR2"}]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    assert main(["slurm", "status", str(run)]) == 0
    out = capsys.readouterr().out
    assert "step 14, train loss 0.5 at step 10" in out, out
    assert latest_step(records + [{"step": 14, "split": "resume", "epoch": 0}]) == 14


def test_sweep_status_shows_the_step_of_a_stop(tmp_path):
    from hpctrain.sweep.spec import build_sweep
    from hpctrain.sweep.status import collect_status

    plan, _ = build_sweep("digits", None, ("train.max_steps=40",), ["optim.lr=0.1,0.2"], str(tmp_path / "s"))
    run = plan.run_dir(plan.points[0])
    run.mkdir(parents=True)
    records = [{"step": 10, "split": "train", "epoch": 0, "loss": 0.5},
               {"step": 14, "split": "stop", "epoch": 0, "signal": "SIGTERM"}]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    assert [s.step for s in collect_status(plan)] == [14, None]


def test_status_and_logs_go_on_when_scontrol_does_not_answer(tmp_path, slurm, capsys):
    """A controller that briefly does not answer (or PrivateData's refusal) is no error for status, which shows
    sacct's record instead, nor for logs, which says it found no log and why."""
    sacct = slurm.root / "bin" / "sacct"
    sacct.write_text("#!/bin/sh\necho 'RUNNING|0:0|00:05:00|node3'\n")
    sacct.chmod(0o755)
    run = tmp_path / "run"
    record_job(run, "4100")
    slurm.state.write_text("TIMEOUT")
    assert main(["slurm", "status", str(run)]) == 0
    said = capsys.readouterr()
    assert "job 4100: RUNNING" in said.out and "Socket timed out" in said.err and "asking sacct" in said.err
    assert main(["slurm", "logs", str(run)]) == 2
    err = capsys.readouterr().err
    assert "no log file of job 4100" in err and "Slurm did not say where job 4100 writes its log" in err
