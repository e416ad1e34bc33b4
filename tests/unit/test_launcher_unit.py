import sys

from hpctrain.dist.launcher import torchrun_command
from hpctrain.dist.torchrun_main import exit_code
from hpctrain.train.entry import TrainRequest


def test_worker_exit_codes_pass_through():
    assert exit_code(2) == 2  # bad input in a worker stays "bad input"
    assert exit_code(-9) == 137 and exit_code(-15) == 143  # killed by a signal, as a shell reports it
    assert exit_code(0) == 1  # a failure record with code 0 is still a failure


def test_torchrun_command_reruns_the_same_request_without_nproc():
    req = TrainRequest("digits", "cfg.toml", ("train.max_steps=3",), 4, True)
    cmd = torchrun_command(4, req.module_args())
    assert cmd[:3] == [sys.executable, "-m", "hpctrain.dist.torchrun_main"]
    assert "--standalone" in cmd and "--nproc-per-node=4" in cmd
    tail = cmd[cmd.index("hpctrain") + 1:]
    assert tail[:2] == ["train", "digits"] and tail[2] == "--config" and tail[3].endswith("/cfg.toml")
    assert tail[4:] == ["train.max_steps=3", "--debug"]
    assert not any("nproc" in a for a in tail)


def test_first_failure_prefers_the_cause_over_torchruns_shutdown_sigterm():
    from types import SimpleNamespace

    from hpctrain.dist.torchrun_main import first_failure

    err = SimpleNamespace(failures={
        0: SimpleNamespace(timestamp=100, exitcode=-15),  # killed by torchrun's shutdown
        1: SimpleNamespace(timestamp=100, exitcode=-9),   # the rank that died
        2: SimpleNamespace(timestamp=99, exitcode=-15),   # earlier still: a real SIGTERM comes first
    })
    assert first_failure(err)[0] == 2
    del err.failures[2]
    assert first_failure(err)[0] == 1
