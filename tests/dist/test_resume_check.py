"""`hpctrain check resume` (issue 40, section 5) with real processes, and bad use of the session API in a script:
a message and exit code 2, a rank that raises alone ends the run within seconds."""

import time
from pathlib import Path

import pytest

from tests.conftest import TESTS, run_hpctrain

pytestmark = [pytest.mark.dist, pytest.mark.timeout(300)]


def check(target: str, *args: str, expect: int):
    result = run_hpctrain(["check", "resume", target, "--steps", "6", *args], 240)
    assert result.returncode == expect, result.output
    return result.stdout


def test_a_loop_that_registers_everything_resumes_exactly():
    out = check(str(TESTS / "gan_loop.py"), expect=0)
    assert "stopped at step 4 of 6; resumed exactly" in out


def test_an_experiment_resumes_exactly():
    assert "resumed exactly" in check("toy_experiment:LinearToy", expect=0)


def test_an_unregistered_scheduler_is_found_and_named(tmp_path: Path):
    script = tmp_path / "forgot.py"
    text = (TESTS / "gan_loop.py").read_text()
    script.write_text(text.replace("opt_d=opt_d, schedule=schedule)", "opt_d=opt_d)"))
    out = check(str(script), expect=1)
    assert "step 5, rank 0: the learning rate of optimizer 'opt_g' differs" in out
    assert "a scheduler that is not registered" in out


def test_a_data_loader_of_the_scripts_own_is_found(tmp_path: Path):
    """A shuffling DataLoader draws its order from the global generator when iterated: the resumed run's epoch is
    another order, and the check says the micro-batches differ."""
    script = tmp_path / "own_loader.py"
    text = (TESTS / "token_loop.py").read_text()
    script.write_text(text.replace("run.steps(sequences(), collate_fn=pad)", "run.steps(torch.utils.data.DataLoader("
                                   "sequences(), batch_size=4, shuffle=True, collate_fn=pad))"))
    out = check(str(script), expect=1)
    assert "the micro-batches differ" in out


def test_bad_use_in_a_script_is_a_message_and_exit_2(tmp_path: Path):
    script = tmp_path / "bad.py"
    script.write_text("import hpctrain\nwith hpctrain.session({'log.tensorboard': False}) as run:\n"
                      "    run.register(counter=object())\n")
    result = run_hpctrain(["train", str(script), f"run.dir={tmp_path / 'run'}"], 120, cwd=tmp_path)
    assert result.returncode == 2, result.output
    assert "hpctrain: error: run.register: 'counter' (object) has no state_dict" in result.stderr
    assert "HINT:" in result.stderr and "Traceback" not in result.stderr


def test_a_loop_that_raises_on_one_rank_ends_the_run_within_seconds(tmp_path: Path):
    script = tmp_path / "raises.py"
    script.write_text((TESTS / "token_loop.py").read_text().replace(
        "        step.optimizer_step()",
        "        step.optimizer_step()\n        if run.rank == 1 and step.index == 2:\n"
        "            raise ValueError('rank 1 cannot go on')"))
    started = time.monotonic()
    result = run_hpctrain(["train", str(script), "--nproc-per-node=2", f"run.dir={tmp_path / 'run'}",
                           "train.max_steps=50"], 90)
    assert result.returncode == 1, result.output
    assert time.monotonic() - started < 60  # not the collective timeout's wait
    assert "rank 1 cannot go on" in result.output and "Traceback" in result.output


UNEVEN = '''import torch, hpctrain
with hpctrain.session({"log.tensorboard": False, "train.global_batch_size": 4, "train.micro_batch_size": 2,
                      "train.epochs": 1}) as run:
    model = run.wrap(torch.nn.Linear(3, 1))
    run.register(model=model, opt=torch.optim.SGD(model.parameters(), lr=0.1))
    n = 16 if run.rank == 0 else 24                       # RANK_DATA
    data = torch.utils.data.TensorDataset(torch.randn(n, 3), torch.randn(n, 1))
    for step in run.steps(torch.utils.data.DataLoader(data, batch_size=2)):
        for (x, y), info in step.micro_batches():
            loss = torch.nn.functional.mse_loss(model(x), y)
            step.backward(loss)
            step.log(loss=loss.detach() if run.rank == 0 or step.index < 2 else loss.detach().expand(2))
        step.optimizer_step()
'''


@pytest.mark.parametrize("case", ["uneven data", "misuse on one rank"])
def test_what_one_ranks_data_decides_is_a_message_and_exit_2_within_seconds(tmp_path: Path, case: str):
    """Ranks whose own data give different numbers of steps would end their epochs apart: refused at the start
    on every rank. A value only rank 1 logs wrongly is rank 1's error alone: it leaves at once, and the launcher
    ends rank 0, which waits for it in a collective."""
    script = tmp_path / "uneven.py"
    script.write_text(UNEVEN if case == "uneven data" else UNEVEN.replace("16 if run.rank == 0 else 24", "16"))
    started = time.monotonic()
    result = run_hpctrain(["train", str(script), "--nproc-per-node=2", f"run.dir={tmp_path / 'run'}"], 120,
                          cwd=tmp_path)
    assert result.returncode == 2, result.output
    assert time.monotonic() - started < 60
    if case == "uneven data":
        assert "the ranks' own data give 8 to 12 steps per epoch" in result.stderr
        printed = [line for line in result.stderr.splitlines() if line.startswith("hpctrain: error:")]
        assert len(printed) == 1, result.stderr  # rank 0's, for every rank (the launcher's summary line aside)
        assert "Traceback" not in result.stderr
    else:  # rank 0's own error (the peer that left closed its connection) comes after and is not the first
        assert "rank 1 (local rank 1, pid" in result.stderr and \
            "failed first, exit code 2: hpctrain: error: [rank 1] step.log: a tensor of shape [2]" in result.stderr
        assert "HINT: log one number" in result.stderr and "[rank1]: Traceback" not in result.stderr


@pytest.mark.parametrize("code", [0, 3])
def test_sys_exit_inside_the_session_ends_the_process_with_its_code(tmp_path: Path, code: int):
    """As without the session: nothing after the with block runs (a sys.exit(0) on rank 0 only must not leave
    the other ranks' code running after it on one rank)."""
    import subprocess
    import sys

    script = tmp_path / "exits.py"
    script.write_text("import sys, hpctrain\nwith hpctrain.session({'log.tensorboard': False}) as run:\n"
                      f"    sys.exit({code})\nprint('after the session')\n")
    result = subprocess.run([sys.executable, str(script)], capture_output=True,
                            text=True, timeout=120, cwd=tmp_path)
    assert result.returncode == code, result.stderr
    assert "after the session" not in result.stdout
