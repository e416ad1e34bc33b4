import sys

from hpctrain.dist.launcher import torchrun_command
from hpctrain.launch import exit_code
from hpctrain.train.entry import TrainRequest


def test_worker_exit_codes_pass_through():
    assert exit_code(2) == 2  # bad input in a worker stays "bad input"
    assert exit_code(-9) == 137 and exit_code(-15) == 143  # killed by a signal, as a shell reports it
    assert exit_code(0) == 1  # a failure record with code 0 is still a failure


def test_torchrun_command_reruns_the_same_request_without_nproc():
    req = TrainRequest("digits", "cfg.toml", ("train.max_steps=3",), 4, True)
    cmd = torchrun_command(4, req.module_args())
    assert cmd[:3] == [sys.executable, "-m", "hpctrain.launch"]
    assert "--standalone" in cmd and "--nproc-per-node=4" in cmd
    tail = cmd[cmd.index("hpctrain") + 1:]
    assert tail[:2] == ["train", "digits"] and tail[2] == "--config" and tail[3].endswith("/cfg.toml")
    assert tail[4:] == ["train.max_steps=3", "--debug"]
    assert not any("nproc" in a for a in tail)


def test_first_failure_prefers_the_cause_over_torchruns_shutdown_sigterm():
    from types import SimpleNamespace

    from hpctrain.launch import first_failure

    lost_peer = {"message": "RuntimeError: [gloo/pair.cc:561] Connection closed by peer [127.0.0.1]:123. "
                            "This is typically caused by a remote worker crashing."}
    err = SimpleNamespace(failures={
        0: SimpleNamespace(timestamp=99, exitcode=1, message=lost_peer),  # its error came first, but says why
        1: SimpleNamespace(timestamp=100, exitcode=-9, message=""),  # the rank that died, stamped when noticed
        2: SimpleNamespace(timestamp=100, exitcode=-15, message=""),  # torchrun's shutdown
    })
    assert first_failure(err)[0] == 1
    del err.failures[1]
    assert first_failure(err)[0] == 0  # only consequences left: the earliest
    crash = SimpleNamespace(failures={0: SimpleNamespace(timestamp=100, exitcode=1, message="ValueError: bad batch"),
                                      1: SimpleNamespace(timestamp=100, exitcode=1, message=lost_peer)})
    assert first_failure(crash)[0] == 0


def test_failure_message_keeps_a_user_errors_message_before_its_hint():
    from types import SimpleNamespace

    from hpctrain.launch import failure_message

    user = SimpleNamespace(message={"message": "DataError: sample '7' of shard s.tar: cannot decode .png\nHINT: re-create it."})
    assert failure_message(user) == "DataError: sample '7' of shard s.tar: cannot decode .png (HINT: re-create it.)"
    crash = SimpleNamespace(message="Traceback (most recent call last):\n  ...\nRuntimeError: boom")
    assert failure_message(crash) == "RuntimeError: boom"
    assert failure_message(SimpleNamespace(message="To enable traceback see: ...")) == ""
    ddp = SimpleNamespace(message={"message": (
        "RuntimeError: Expected to have finished reduction in the prior iteration before starting a new one.\n"
        "Parameter indices which did not receive grad for rank 0: 3 4\n"
        " In addition, you can set the environment variable TORCH_DISTRIBUTED_DEBUG to either INFO or DETAIL")})
    assert failure_message(ddp).startswith("RuntimeError: Expected to have finished reduction")  # the error, not advice


def test_ddps_unused_parameter_error_says_what_to_set():
    from hpctrain.errors import UserError
    from hpctrain.train.run import translate_error

    err = translate_error(RuntimeError(
        "Expected to have finished reduction in the prior iteration before starting a new one. This error indicates "
        "that your module has parameters that were not used in producing loss. ...\nParameter indices which did not "
        "receive grad for rank 1: 3 4\n In addition, you can set the environment variable TORCH_DISTRIBUTED_DEBUG"))
    assert isinstance(err, UserError) and "set dist.find_unused_parameters=true" in err.hint
    assert str(err).startswith("DDP: some trainable parameters got no gradient in this step (rank 1: parameter "
                               "indices 3 4)")
    other = ValueError("x")
    assert translate_error(other) is other


def test_the_done_line_says_which_step_an_earlier_validation_was_at():
    from hpctrain.train.run import done_val

    assert done_val({"loss": 0.5, "accuracy": 0.9, "iou/x": 1.0}, 14, 14) == "; val loss 0.5000, accuracy 0.9000"
    assert done_val({"loss": 0.5}, 14, 25) == "; val at step 14: loss 0.5000"  # train.stop_at_step=25
    assert done_val({}, 0, 25) == ""
