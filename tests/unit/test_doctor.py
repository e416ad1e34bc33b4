"""`hpctrain doctor` checks on fake environments (the real run is in tests/slurm)."""

from __future__ import annotations

import pytest

from hpctrain import doctor

JOB = {"SLURM_JOB_ID": "7", "SLURM_JOB_NODELIST": "gpu[01-02]", "SLURM_JOB_NUM_NODES": "2"}


def test_torchrun_world_must_match_the_allocation():
    env = {**JOB, "RANK": "0", "LOCAL_WORLD_SIZE": "4", "WORLD_SIZE": "4", "SLURM_STEP_TASKS_PER_NODE": "1(x2)"}
    c = doctor.check_variables(env)
    assert c.status == "fail" and "--nnodes" in c.detail
    assert doctor.check_variables({**env, "WORLD_SIZE": "8"}).status == "pass"
    many = doctor.check_variables({**env, "WORLD_SIZE": "8", "SLURM_STEP_TASKS_PER_NODE": "4(x2)"})
    assert many.status == "fail" and "--ntasks-per-node=1" in many.detail
    assert doctor.check_variables({}).status == "skip"


def test_master_address_from_the_node_list_and_resolution():
    assert doctor.master_addr(JOB) == "gpu01"

    def fail(name):
        raise OSError("Name or service not known")

    assert doctor.check_master(JOB, lambda n: "10.0.0.1").status == "pass"
    bad = doctor.check_master(JOB, fail)
    assert bad.status == "fail" and "gpu01" in bad.detail


@pytest.mark.parametrize("value,status", [
    ("ib", "pass"), ("ib0", "pass"), ("=ib", "fail"), ("^ib,lo", "pass"), ("^eth,ib,lo", "fail"), ("docker", "fail"),
])
def test_socket_ifname_follows_nccl_matching_rules(value, status):
    assert doctor.check_socket_ifname({"NCCL_SOCKET_IFNAME": value}, ["eth0", "ib0", "lo"]).status == status


def test_port_checked_on_the_master_only():
    env = {"MASTER_ADDR": "gpu01", "MASTER_PORT": "29500"}
    assert doctor.check_port(env, "gpu02", lambda p: None).status == "skip"
    assert doctor.check_port(env, "gpu01.cluster", lambda p: None).status == "pass"

    def busy(port):
        raise OSError(98, "Address already in use")

    c = doctor.check_port(env, "gpu01", busy)
    assert c.status == "fail" and "29500" in c.detail


def test_cpus_not_passed_to_srun():
    assert doctor.check_cpus({"SLURM_CPUS_PER_TASK": "16"}, 1).status == "warn"
    assert doctor.check_cpus({"SLURM_CPUS_PER_TASK": "16"}, 16).status == "pass"
