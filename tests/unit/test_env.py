import pytest

from hpctrain.dist.env import detect_launch, expand_nodelist, parse_tasks_per_node
from hpctrain.errors import UserError

TORCHRUN = {
    "RANK": "5", "LOCAL_RANK": "1", "WORLD_SIZE": "6", "LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "2",
    "MASTER_ADDR": "node1", "MASTER_PORT": "29400", "TORCHELASTIC_RUN_ID": "x",
}
SRUN = {
    "SLURM_JOB_ID": "4242", "SLURM_PROCID": "3", "SLURM_LOCALID": "1", "SLURM_NODEID": "1",
    "SLURM_STEP_NUM_TASKS": "6", "SLURM_STEP_NUM_NODES": "3", "SLURM_STEP_NODELIST": "gpu[07-09]",
    "SLURM_STEP_TASKS_PER_NODE": "2(x3)", "SLURM_NTASKS": "6", "SLURM_JOB_NODELIST": "gpu[07-09]",
}


def test_torchrun():
    info = detect_launch(TORCHRUN)
    assert (info.launcher, info.rank, info.local_rank, info.world_size) == ("torchrun", 5, 1, 6)
    assert (info.local_world_size, info.node_rank, info.num_nodes) == (2, 2, 3)
    assert (info.master_addr, info.master_port) == ("node1", 29400)


def test_torchrun_node_count_comes_from_torchrun_when_nodes_run_different_process_counts():
    """World 12 as 8 + 4 processes: world / local world would say 1 node on one and 3 on the other."""
    eight = {**TORCHRUN, "WORLD_SIZE": "12", "LOCAL_WORLD_SIZE": "8", "GROUP_RANK": "0", "GROUP_WORLD_SIZE": "2"}
    four = {**eight, "LOCAL_WORLD_SIZE": "4", "GROUP_RANK": "1"}
    assert detect_launch(eight).num_nodes == detect_launch(four).num_nodes == 2


def test_torchrun_inside_a_slurm_job_wins_over_slurm_variables():
    info = detect_launch({**SRUN, **TORCHRUN, "SLURM_PROCID": "0", "SLURM_STEP_NUM_TASKS": "3"})
    assert info.launcher == "torchrun" and info.world_size == 6 and info.job_id == "4242"


def test_srun_one_task_per_gpu():
    info = detect_launch(SRUN)
    assert (info.launcher, info.rank, info.local_rank, info.world_size) == ("srun", 3, 1, 6)
    assert (info.local_world_size, info.node_rank, info.num_nodes) == (2, 1, 3)
    assert info.master_addr == "gpu07"
    assert info.master_port == 15000 + 4242  # derived from the job id: two jobs on a node do not collide
    assert detect_launch({**SRUN, "MASTER_PORT": "1234", "MASTER_ADDR": "h"}).master_port == 1234


def test_batch_script_is_not_mistaken_for_rank_0():
    # sbatch's batch step has SLURM_PROCID=0 and SLURM_NTASKS, but no step variables.
    batch_env = {"SLURM_JOB_ID": "1", "SLURM_PROCID": "0", "SLURM_NTASKS": "4", "SLURM_JOB_NODELIST": "n[1-2]"}
    info = detect_launch(batch_env)
    assert info.launcher == "single" and info.world_size == 1 and info.job_id == "1"


def test_single_process():
    info = detect_launch({})
    assert (info.launcher, info.rank, info.world_size) == ("single", 0, 1)


def test_partial_torchrun_variables_are_an_error_with_a_hint():
    with pytest.raises(UserError, match="WORLD_SIZE='two' is not an integer") as err:
        detect_launch({"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "two"})
    assert "torchrun" in err.value.hint


@pytest.mark.parametrize(
    "text, hosts",
    [
        ("node1", ["node1"]),
        ("gpu[01-03,07]", ["gpu01", "gpu02", "gpu03", "gpu07"]),
        ("a[1-2],login5,b[9-10]", ["a1", "a2", "login5", "b9", "b10"]),
        ("r[1-2]n[3-4]", ["r1n3", "r1n4", "r2n3", "r2n4"]),
        ("x[008-010]-ib", ["x008-ib", "x009-ib", "x010-ib"]),
    ],
)
def test_expand_nodelist(text, hosts):
    assert expand_nodelist(text) == hosts


def test_tasks_per_node():
    assert parse_tasks_per_node("2(x3),1") == [2, 2, 2, 1]
    assert parse_tasks_per_node("4") == [4]
    assert parse_tasks_per_node("") == []
