"""The scaling planner's arithmetic against hand-computed cases, and the command end to end on CPU."""

import json
from pathlib import Path

import pytest

from hpctrain.cli import main
from hpctrain.perf.plan import ClusterShape, StepProfile, advise, allreduce_seconds, bucket_sizes, estimate, exposed_communication

# forward 100 ms, backward 200 ms, optimizer 10 ms, 100 MB of gradients, micro batch 32
PROFILE = StepProfile(forward_s=0.1, backward_s=0.2, optimizer_s=0.01, grad_bytes=100_000_000, micro_batch=32)


def test_ring_allreduce_time_is_bytes_times_two_n_minus_one_over_n_over_busbw():
    assert allreduce_seconds(25e6, 4, 10.0) == pytest.approx(25e6 * 2 * 3 / 4 / 10e9)  # 3.75 ms
    assert allreduce_seconds(25e6, 1, 10.0) == 0.0
    assert bucket_sizes(100, 30) == [30, 30, 30, 10]


def test_hidden_communication_only_the_last_bucket_shows():
    # 4 ranks at 10 GB/s: each 25 MB bucket takes 3.75 ms, ready every 50 ms of backward:
    # all but the last are hidden; the last starts at 200 ms and ends at 203.75 ms.
    e = estimate(PROFILE, ClusterShape(2, 2, bucket_bytes=25_000_000), busbw_gbps=10.0)
    assert e.compute_s == pytest.approx(0.31)
    assert e.comm_s == pytest.approx(0.015)
    assert e.exposed_comm_s == pytest.approx(0.00375)
    assert e.step_s == pytest.approx(0.31375)
    assert e.efficiency == pytest.approx(0.31 / 0.31375)
    assert e.samples_per_s == pytest.approx(4 * 32 / 0.31375)


def test_communication_bound_buckets_queue_up():
    # 0.1 GB/s: a bucket takes 375 ms; ready at 50/100/150/200 ms -> ends 425, 800, 1175, 1550 ms.
    e = estimate(PROFILE, ClusterShape(2, 2, bucket_bytes=25_000_000), busbw_gbps=0.1)
    assert e.exposed_comm_s == pytest.approx(1.55 - 0.2)
    assert e.step_s == pytest.approx(0.31 + 1.35)
    assert exposed_communication(0.2, [25, 25, 25, 25], 0.375 / 25) == pytest.approx(1.35)


def test_accumulation_and_compression():
    accum = estimate(PROFILE, ClusterShape(2, 2, grad_accum=4, bucket_bytes=25_000_000), busbw_gbps=0.1)
    assert accum.compute_s == pytest.approx(4 * 0.3 + 0.01)  # the all-reduce happens once per step
    assert accum.exposed_comm_s == pytest.approx(1.35)
    bf16 = estimate(PROFILE, ClusterShape(2, 2, bucket_bytes=25_000_000, compression="bf16"), busbw_gbps=0.1)
    assert bf16.comm_s == pytest.approx(0.75)  # half the bytes: 187.5 ms per bucket -> ends at 800 ms
    assert bf16.exposed_comm_s == pytest.approx(0.8 - 0.2)
    single = estimate(PROFILE, ClusterShape(1, 1, bucket_bytes=25_000_000), busbw_gbps=0.1)
    assert single.exposed_comm_s == 0 and single.efficiency == 1.0


def test_advice_names_the_accumulation_that_reaches_the_target():
    advice = advise(PROFILE, ClusterShape(2, 2, bucket_bytes=25_000_000), busbw_gbps=1.0)
    # 1 GB/s: 37.5 ms per bucket; ready at 50, 100, 150, 200 -> last ends at 237.5: 37.5 ms exposed of 347.5 ms.
    assert advice.bound
    assert "communication-bound" in advice.lines[0] and "89%" in advice.lines[0]
    assert any("bf16" in line for line in advice.lines)
    # 2 micro-batches: 37.5 / (0.61 + 0.0375) -> 94%.
    assert any(line.startswith("2 micro-batches per step") and "94%" in line for line in advice.lines)
    assert not advise(PROFILE, ClusterShape(2, 2, bucket_bytes=25_000_000), busbw_gbps=10.0).bound


def test_plan_command_measures_and_prints(capsys):
    code = main(["plan", "digits", "--nodes", "3", "--gpus-per-node", "2", "--busbw", "0.01", "--steps", "2",
                 "model.width=8", "train.global_batch_size=48", "train.micro_batch_size=8", "data.num_workers=0"])
    out = capsys.readouterr().out
    assert code == 0
    assert "# Scaling plan: digits on 3 node(s) x 2 = 6 ranks" in out
    assert "| planned |" in out and "Assumptions:" in out and "measured on a CPU" in out


def test_plan_reads_bandwidth_from_a_preflight_report_and_says_so(tmp_path: Path, capsys):
    report = {"world_size": 6, "bandwidth": [
        {"bytes": 1024, "busbw_gbps": 0.01}, {"bytes": 16 * 2**20, "busbw_gbps": 2.0}, {"bytes": 1 << 30, "busbw_gbps": 3.0}]}
    (tmp_path / "preflight.json").write_text(json.dumps(report))
    code = main(["plan", "digits", "--nodes", "1", "--gpus-per-node", "2", "--preflight", str(tmp_path), "--json",
                 "--steps", "1", "model.width=8", "train.global_batch_size=16", "train.micro_batch_size=8",
                 "data.num_workers=0"])
    out = json.loads(capsys.readouterr().out)
    assert code == 0
    assert out["busbw_gbps"] == 2.0 and "16 MiB messages" in out["busbw_source"]  # nearest to the 25 MiB bucket
    assert out["estimate"]["layout"]["grad_accum"] == 1


@pytest.mark.parametrize("args, message", [
    (["--nodes", "2", "--gpus-per-node", "2"], "needs the bus bandwidth"),
    (["--nodes", "0", "--gpus-per-node", "2", "--busbw", "1"], "at least 1"),
    (["--nodes", "3", "--gpus-per-node", "1", "--busbw", "1", "train.global_batch_size=100"], "cannot be split evenly"),
    (["--nodes", "1", "--gpus-per-node", "2", "--preflight", "/nonexistent/preflight.json"], "cannot read the bandwidth"),
])
def test_plan_bad_input_is_a_message(args, message, capsys):
    assert main(["plan", "digits", *args]) == 2
    assert message in capsys.readouterr().err
