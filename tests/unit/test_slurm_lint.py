"""`hpctrain slurm check` findings, the job helpers, and the slurm CLI's bad-input paths."""

from __future__ import annotations

import dataclasses
import json
import os
import re

import pytest

from hpctrain.cli import main
from hpctrain.config.load import load_config
from hpctrain.config.validate import ConfigError
from hpctrain.experiments import resolve_experiment
from hpctrain.slurm import job
from hpctrain.slurm.facts import Facts, NodeFacts, gres_gpus
from hpctrain.slurm.lint import lint
from hpctrain.units import time_limit_seconds


def cfg(*overrides: str, run_dir: str = "/shared/runs/x"):
    cls = resolve_experiment("digits")
    return load_config("digits", cls.config_class, experiment_defaults=cls.defaults,
                       overrides=[f"run.dir={run_dir}", *overrides])


def findings(*overrides: str, facts: Facts | None = None, run_dir: str = "/shared/runs/x"):
    c = cfg(*overrides, run_dir=run_dir)
    spec = dataclasses.replace(job.job_spec(c), python="/usr/bin/python3", venv="")
    facts = facts or Facts(run_dir_fs="nfs4", existing=frozenset({"/usr/bin/python3"}))
    return {(f.level, f.key) for f in lint(c, spec, facts)}, lint(c, spec, facts)


def test_a_sensible_job_has_no_findings():
    assert findings("slurm.nodes=2", "slurm.gpus_per_node=2", "ckpt.every_minutes=30")[0] == set()


def test_srun_launcher():
    assert findings("slurm.launcher=srun", "slurm.nodes=2", "slurm.gpus_per_node=2", "ckpt.every_minutes=30")[0] == set()
    assert findings("slurm.launcher=srun", "slurm.gpus=false", "slurm.gpus_per_node=2", "slurm.cpus_per_task=2",
                    "ckpt.every_minutes=30")[0] == set()
    # each srun task gets cpus_per_task / gpus_per_node CPUs: a remainder would sit idle
    keys, found = findings("slurm.launcher=srun", "slurm.gpus_per_node=4", "slurm.cpus_per_task=10")
    assert ("warning", "slurm.cpus_per_task") in keys
    assert "each gets 2 (--cpus-per-task), 2 stay idle" in next(f.message for f in found if f.key == "slurm.cpus_per_task")
    # torchrun's one task per node takes them all; too few for the tasks is the error of the CPU check
    assert ("warning", "slurm.cpus_per_task") not in findings("slurm.gpus_per_node=4", "slurm.cpus_per_task=10")[0]
    keys = findings("slurm.launcher=srun", "slurm.gpus_per_node=4", "slurm.cpus_per_task=3")[0]
    assert ("error", "slurm.cpus_per_task") in keys and ("warning", "slurm.cpus_per_task") not in keys


def test_batch_not_divisible_by_the_new_world_size():
    keys, found = findings("slurm.nodes=3", "slurm.gpus_per_node=2", "ckpt.every_minutes=30")
    assert ("error", "train.global_batch_size") in keys
    assert "3 nodes x 2" in next(f.message for f in found if f.key == "train.global_batch_size")


def test_cpus_and_workers():
    assert ("error", "slurm.cpus_per_task") in findings("slurm.gpus_per_node=4", "slurm.cpus_per_task=2")[0]
    keys, found = findings("slurm.gpus_per_node=4", "slurm.cpus_per_task=8", "data.num_workers=4")
    assert ("warning", "data.num_workers") in keys
    assert "slurm.cpus_per_task=20" in next(f.hint for f in found if f.key == "data.num_workers")


def test_time_limit_against_signal_lead_and_checkpoints():
    assert ("error", "slurm.signal_lead_s") in findings("slurm.time=2", "slurm.signal_lead_s=300")[0]
    assert ("warning", "slurm.signal_lead_s") in findings("slurm.signal_lead_s=20")[0]
    assert ("warning", "fault.warning_signal") in findings("fault.warning_signal=none")[0]
    assert ("warning", "ckpt.every_minutes") in findings("slurm.time=30", "ckpt.every_minutes=60", "ckpt.every_steps=0")[0]
    assert ("warning", "ckpt.every_minutes") not in findings("slurm.time=30", "ckpt.every_steps=100")[0]


def test_run_dir_not_visible_from_other_nodes():
    assert ("warning", "run.dir") in findings(run_dir="/tmp/runs/x")[0]
    local = Facts(run_dir_fs="ext4", existing=frozenset({"/usr/bin/python3"}))
    assert ("warning", "run.dir") in findings("slurm.nodes=2", facts=local)[0]
    assert ("warning", "run.dir") not in findings("slurm.nodes=1", facts=local)[0]


def test_environment_checks():
    none = Facts(run_dir_fs="nfs")
    assert ("error", "slurm.python") in findings(facts=none)[0]
    keys = findings("slurm.container=/images/x.sif", "slurm.modules=['CUDA']", facts=none)[0]
    assert {("error", "slurm.container"), ("warning", "slurm.container_runtime"), ("warning", "slurm.modules")} <= keys
    assert ("error", "dist.backend") in findings("dist.backend=nccl", "slurm.gpus=false")[0]


def data_facts(fs: str, size: float, **kw) -> Facts:
    """Facts of shards at /lustre/p/set (train and test) of ``size`` bytes on an ``fs`` filesystem."""
    return Facts(run_dir_fs="nfs", existing=frozenset({"/usr/bin/python3"}), data_fs=fs, data_bytes=int(size),
                 data_dirs=("/lustre/p/set/train", "/lustre/p/set/test"), **kw)


def staging_findings(*overrides: str, facts: Facts) -> list:
    return [f for f in findings(*overrides, facts=facts)[1] if f.key == "data.stage_dir"]


def test_large_shards_on_a_network_filesystem_are_worth_staging():
    [found] = staging_findings(facts=data_facts("lustre", 200e9))
    assert found.level == "warning"
    assert found.message == ("the shards in /lustre/p/set (200 GB) are on a lustre filesystem and larger than a "
                             "node's page cache keeps (about 32 GB): in the exact order every node reads up to all "
                             "of them from it in every epoch")
    assert found.hint == ("copy them once per node and job to a node-local disk: data.stage_dir=$TMPDIR (or a local "
                          "NVMe path); the cost is 200 GB read per node when each job starts")
    assert not staging_findings(facts=data_facts("lustre", 20e9)), "the page cache keeps it after the first epoch"
    assert not staging_findings(facts=data_facts("ext4", 200e9)), "already node-local"
    big_nodes = (NodeFacts(cpus=64, gpus=4, memory_mb=1_000_000, count=8),)
    assert not staging_findings(facts=data_facts("gpfs", 200e9, nodes=big_nodes)), "sinfo: 1 TB nodes keep it"
    assert not staging_findings("data.order=shard_local", facts=data_facts("lustre", 200e9)), \
        "shard_local reads the set about once per epoch across nodes: less than a staged copy on every node"
    staged = data_facts("lustre", 200e9, stage_free=10**12, stage_fs="xfs")
    assert not staging_findings("data.stage_dir=/local/nvme", facts=staged)


def test_a_stage_dir_that_cannot_hold_the_shards():
    [small] = staging_findings("data.stage_dir=/local/nvme", facts=data_facts("lustre", 200e9, stage_free=50 * 10**9))
    assert (small.level, small.message) == ("warning", "/local/nvme has 50 GB free here, the shards in /lustre/p/set "
                                            "need 200 GB: staging would stop with an error")
    assert small.hint == ("point data.stage_dir at a larger node-local disk, free space there, or leave it empty to "
                          "read the shards where they are")
    [unknown] = staging_findings("data.stage_dir=$SLURM_TMPDIR", facts=data_facts("lustre", 200e9))
    assert unknown.format() == ("INFO    data.stage_dir: $SLURM_TMPDIR is set per node and job: its free space "
                                "cannot be checked here\n        -> make sure it holds 200 GB on every node (one "
                                "copy of the shards per node)")
    [shared] = staging_findings("data.stage_dir=/scratch/me", facts=data_facts("lustre", 9e9, stage_free=10**15,
                                                                             stage_fs="lustre"))
    assert "/scratch/me is on a lustre filesystem: staging would copy the shards from one shared" in shared.message
    assert not staging_findings("data.stage_dir=$TMPDIR", facts=data_facts("lustre", 0)), "no manifest found: silent"


def test_the_facts_of_the_data_are_gathered_from_the_manifests(tmp_path, monkeypatch):
    from hpctrain.data.shards import write_split
    from hpctrain.filesystems import filesystem_type
    from hpctrain.slurm.facts import gather_facts
    from tests.unit.test_shards import _samples

    for split, n in (("train", 30), ("test", 10)):
        write_split(tmp_path / "set" / split, split, _samples(n), max_bytes=6_000)
    cls = resolve_experiment("tests.shard_experiment:ShardClassifier")

    def facts(stage_dir: str) -> Facts:
        c = load_config("tests.shard_experiment:ShardClassifier", cls.config_class, experiment_defaults=cls.defaults,
                        overrides=[f"run.dir={tmp_path / 'run'}", f"model.shards={tmp_path / 'set'}",
                                   f"data.stage_dir={stage_dir}"])
        return gather_facts(c, job.job_spec(c), cls(c).shard_dirs())

    here = facts(str(tmp_path))
    assert here.data_dirs == (str(tmp_path / "set" / "train"), str(tmp_path / "set" / "test"))
    assert here.data_bytes == sum(p.stat().st_size for p in (tmp_path / "set").rglob("*.tar"))
    assert here.data_fs == here.stage_fs == filesystem_type(tmp_path) and here.stage_free > 0
    train = list((tmp_path / "set" / "train").glob("*.tar"))
    assert (here.train_shards, here.train_bytes) == (len(train), sum(p.stat().st_size for p in train))
    assert facts("$SLURM_TMPDIR").stage_free == facts(str(tmp_path / "only-on-nodes")).stage_free == -1
    monkeypatch.setenv("HPCTRAIN_TEST_SCRATCH", str(tmp_path))
    assert facts("${HPCTRAIN_TEST_SCRATCH}").stage_free > 0, "a variable of the user's, set here, is expanded here"


def test_shard_local_with_too_few_shards_per_rank():
    few = data_facts("lustre", 200e9, train_shards=24, train_bytes=160 * 10**9)
    [found] = [f for f in findings("data.order=shard_local", "slurm.nodes=4", "slurm.gpus_per_node=4", facts=few)[1]
               if f.key == "data.order"]
    assert found.level == "warning"
    assert found.message == ("data.order=shard_local with 24 training shards for 16 ranks: up to about 17% of each epoch is "
                             "read from other ranks' shards, which undoes the local reads")
    assert found.hint == "write a multiple of 16 shards, e.g. 32 (hpctrain shard --shard-size about 5000MB), or use " \
                         "data.order=exact"
    enough = data_facts("lustre", 200e9, train_shards=33, train_bytes=160 * 10**9)  # 1 of 16 ranks holds one more
    assert not [f for f in findings("data.order=shard_local", "slurm.nodes=4", "slurm.gpus_per_node=4",
                                    facts=enough)[1] if f.key == "data.order"]
    assert not [f for f in findings("slurm.nodes=4", "slurm.gpus_per_node=4", facts=few)[1] if f.key == "data.order"]


def test_partition_capacity_from_sinfo():
    facts = Facts(run_dir_fs="nfs", existing=frozenset({"/usr/bin/python3"}),
                  nodes=(NodeFacts(cpus=64, gpus=4, memory_mb=500_000, count=2),))
    assert not [k for k in findings("slurm.gpus_per_node=4", facts=facts)[0] if k[0] == "error"]
    assert ("error", "slurm.gpus_per_node") in findings("slurm.gpus_per_node=8", facts=facts)[0]
    assert ("error", "slurm.nodes") in findings("slurm.nodes=4", "slurm.gpus_per_node=4", facts=facts)[0]
    assert ("error", "slurm.cpus_per_task") in findings("slurm.cpus_per_task=128", facts=facts)[0]


def partition(*nodes: tuple[int, int, int]) -> Facts:
    """A fake sinfo: (cpus, gpus, count) per node type."""
    return Facts(run_dir_fs="nfs", existing=frozenset({"/usr/bin/python3"}),
                 nodes=tuple(NodeFacts(cpus=c, gpus=g, memory_mb=100_000, count=n) for c, g, n in nodes))


def proposals(hint: str) -> list[list[str]]:
    """The alternatives a hint offers ('A or B with C'), each as the overrides it names."""
    found = [re.findall(r"\b((?:slurm|data|ckpt)\.[a-z_]+=-?\d+(?:\.\d+)?)", part) for part in hint.split(" or ")]
    return [overrides for overrides in found if overrides]


# (overrides, fake partition or None for no sinfo, the finding whose hint is followed)
HINTED = [
    # 2-CPU nodes, 2 processes per node: the hint used to be cpus_per_task=16, which the same check refused.
    (["slurm.gpus=false", "slurm.gpus_per_node=2", "slurm.cpus_per_task=1"], [(2, 0, 4)], ("error", "slurm.cpus_per_task")),
    (["slurm.gpus=false", "slurm.gpus_per_node=2"], [(2, 0, 4)], ("error", "slurm.cpus_per_task")),
    (["slurm.gpus=false", "slurm.gpus_per_node=2", "slurm.cpus_per_task=1", "data.num_workers=3"], [(2, 0, 4)],
     ("error", "slurm.cpus_per_task")),
    (["slurm.gpus=false", "slurm.gpus_per_node=4", "slurm.cpus_per_task=1"], [(2, 0, 4)], ("error", "slurm.cpus_per_task")),
    (["slurm.gpus=false", "slurm.gpus_per_node=2", "slurm.cpus_per_task=2", "data.num_workers=2"], [(2, 0, 4)],
     ("warning", "data.num_workers")),
    (["slurm.gpus_per_node=4", "slurm.cpus_per_task=8", "data.num_workers=4"], [(16, 4, 2)], ("warning", "data.num_workers")),
    (["slurm.gpus_per_node=4", "slurm.cpus_per_task=8", "data.num_workers=4"], [(64, 4, 2)], ("warning", "data.num_workers")),
    (["slurm.gpus_per_node=4", "slurm.cpus_per_task=2"], [(64, 4, 2)], ("error", "slurm.cpus_per_task")),
    (["slurm.gpus_per_node=4", "slurm.cpus_per_task=128"], [(64, 4, 2)], ("error", "slurm.cpus_per_task")),
    (["slurm.gpus_per_node=8"], [(64, 4, 2)], ("error", "slurm.gpus_per_node")),
    # Nodes with the GPUs have fewer CPUs than those without: the CPUs that slurm.nodes GPU nodes all have.
    (["slurm.nodes=2", "slurm.gpus_per_node=4", "slurm.cpus_per_task=64"], [(128, 0, 8), (48, 4, 1), (32, 4, 3)],
     ("error", "slurm.nodes")),
    (["slurm.nodes=4", "slurm.gpus_per_node=4"], [(64, 4, 2)], ("error", "slurm.nodes")),
    # No sinfo here: the advice stays the default share.
    (["slurm.gpus_per_node=4", "slurm.cpus_per_task=2"], None, ("error", "slurm.cpus_per_task")),
    (["slurm.gpus_per_node=4", "slurm.cpus_per_task=8", "data.num_workers=4"], None, ("warning", "data.num_workers")),
    (["slurm.time=2", "slurm.signal_lead_s=300"], None, ("error", "slurm.signal_lead_s")),
    # srun tasks: a multiple of the tasks, below (always fits) or above where the partition's nodes have it
    (["slurm.launcher=srun", "slurm.gpus_per_node=4", "slurm.cpus_per_task=10"], None, ("warning", "slurm.cpus_per_task")),
    (["slurm.launcher=srun", "slurm.gpus_per_node=4", "slurm.cpus_per_task=10"], [(12, 4, 2)],
     ("warning", "slurm.cpus_per_task")),
    (["slurm.launcher=srun", "slurm.gpus_per_node=4", "slurm.cpus_per_task=10"], [(11, 4, 2)],
     ("warning", "slurm.cpus_per_task")),
    (["slurm.time=3", "slurm.signal_lead_s=20"], None, ("warning", "slurm.signal_lead_s")),
    (["slurm.time=0:30", "ckpt.every_minutes=60", "ckpt.every_steps=0"], None, ("warning", "ckpt.every_minutes")),
]


@pytest.mark.parametrize("overrides, nodes, finding", HINTED)
def test_every_number_a_hint_proposes_passes_the_same_check(overrides, nodes, finding):
    facts = partition(*nodes) if nodes else None
    keys, found = findings("ckpt.every_minutes=30", *overrides, facts=facts)
    assert finding in keys, found
    hint = next(f.hint for f in found if (f.level, f.key) == finding)
    offered = proposals(hint)
    assert offered, hint
    for proposal in offered:
        after = findings("ckpt.every_minutes=30", *overrides, *proposal, facts=facts)[0]
        assert ("error", finding[1]) not in after, (hint, proposal, after)
        if nodes:  # nothing the hint leads to is refused by the partition
            assert not {k for k in after if k[0] == "error" and k[1] in PARTITION_KEYS}, (hint, proposal, after)
        if finding[0] == "warning":
            assert finding not in after, (hint, proposal, after)


PARTITION_KEYS = {"slurm.cpus_per_task", "slurm.gpus_per_node", "slurm.nodes"}


def test_hints_fit_the_partition():
    """The case from the issue, spelled out: 2-CPU nodes, 2 processes each."""
    _, found = findings("slurm.gpus=false", "slurm.gpus_per_node=2", "slurm.cpus_per_task=1", facts=partition((2, 0, 4)))
    hint = next(f.hint for f in found if f.key == "slurm.cpus_per_task")
    assert "slurm.cpus_per_task=2" in hint and "=16" not in hint
    _, found = findings("slurm.gpus=false", "slurm.gpus_per_node=2", "slurm.cpus_per_task=2", "data.num_workers=2",
                        facts=partition((2, 0, 4)))
    hint = next(f.hint for f in found if f.key == "data.num_workers")
    assert "data.num_workers=0" in hint and "slurm.cpus_per_task" not in hint  # no CPU count fits 6 busy processes


@pytest.mark.parametrize("gres,gpus", [("gpu:a100:4(S:0-1)", 4), ("gpu:2,shard:8", 2), ("(null)", 0),
                                       ("gpu:v100:2,gpu:t4:1", 3)])
def test_gres_gpus(gres, gpus):
    assert gres_gpus(gres) == gpus


@pytest.mark.parametrize("text,seconds", [("90", 5400), ("1:30", 90), ("01:00:00", 3600), ("2-0", 172800),
                                          ("1-12:30", 131400), ("1-00:00:05", 86405), ("UNLIMITED", None)])
def test_time_limits(text, seconds):
    assert time_limit_seconds(text) == seconds


@pytest.mark.parametrize("override,key", [
    ("slurm.time=tomorrow", "slurm.time"), ("slurm.nodes=0", "slurm.nodes"),
    ("slurm.env=['1BAD=x']", "slurm.env"), ("slurm.extra_sbatch=['mail-type=END']", "slurm.extra_sbatch"),
    ("slurm.job_name=a/b", "slurm.job_name"), ("slurm.port=80", "slurm.port"),
])
def test_bad_slurm_values_name_the_key(override, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        cfg(override)


@pytest.mark.parametrize("key, item", [
    ("env", "HPCTRAIN_ALERT_WEBHOOK=https://hooks.example.org/secret-token"),
    ("env", "HPCTRAIN_ALERT_WEBHOOK =https://hooks.example.org/secret-token"),
    ("env", "HPCTRAIN_ALERT_WEBHOOK https://hooks.example.org/secret-token"),
    ("env", "export HPCTRAIN_ALERT_WEBHOOK=https://hooks.example.org/secret-token"),
    ("extra_sbatch", "--export=ALL,HPCTRAIN_ALERT_WEBHOOK=https://hooks.example.org/secret-token"),
])
def test_the_alert_webhook_is_refused_in_slurm_env_without_echoing_it(key, item):
    """slurm.env and slurm.extra_sbatch go into config.toml, every checkpoint and the job script: no place for a
    credential, under any spelling."""
    with pytest.raises(ConfigError, match=rf"slurm\.{key}.*HPCTRAIN_ALERT_WEBHOOK") as err:
        cfg(f"slurm.{key}=['{item}']")
    said = f"{err.value}\n{err.value.hint}"
    assert "alert.webhook_file" in said and "chmod 600" in said and "--export" in said
    assert "secret-token" not in said and "hooks.example.org" not in said


@pytest.mark.parametrize("key, item", [("env", "API TOKEN=secret-token"), ("extra_sbatch", "comment=secret-token")])
def test_malformed_env_and_sbatch_items_are_named_without_their_values(key, item):
    with pytest.raises(ConfigError, match=f"slurm.{key}") as err:
        cfg(f"slurm.{key}=['{item}']")
    assert "secret-token" not in f"{err.value}\n{err.value.hint}" and item.split("=")[0] in str(err.value)


def test_newlines_cannot_reach_the_script():
    with pytest.raises(ConfigError, match="control characters"):
        cfg("slurm.partition=gpu\necho pwned")


def test_parse_scontrol_fields_keeps_spaces_in_values():
    line = 'JobId=7 JobName=my job "x" UserId=root(0) JobState=RUNNING Reason=None Restarts=1\n'
    fields = job.parse_scontrol_fields(line)
    assert fields["JobName"] == 'my job "x"' and fields["JobState"] == "RUNNING" and fields["Restarts"] == "1"


def test_resolve_target(tmp_path):
    assert job.resolve_target("123") == ("123", None)
    with pytest.raises(Exception, match="neither a job id nor a run directory"):
        job.resolve_target(str(tmp_path / "nope"))
    with pytest.raises(Exception, match="no Slurm job was submitted"):
        job.resolve_target(str(tmp_path))
    (tmp_path / "slurm").mkdir()
    (tmp_path / "slurm" / "jobs.jsonl").write_text(json.dumps({"job_id": "5"}) + "\n" + json.dumps({"job_id": "9"}) + "\n")
    assert job.resolve_target(str(tmp_path)) == ("9", tmp_path)


def test_submit_with_a_stub_sbatch_records_the_job(tmp_path, monkeypatch, capsys):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "sbatch").write_text("#!/bin/sh\necho '4242;cluster'\n")
    (bin_dir / "sbatch").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    run = tmp_path / "shared" / "run"
    assert main(["slurm", "submit", "digits", f"run.dir={run}", "slurm.time=60", "ckpt.every_minutes=20"]) == 0
    assert capsys.readouterr().out.strip() == "4242"
    assert (run / "slurm" / "job_4242.sh").read_text() == (run / "slurm" / "job.sh").read_text()
    assert (run / "logs").is_dir()  # Slurm does not create the --output directory
    assert job.recorded_jobs(run) == ["4242"]


def test_submit_refuses_errors_unless_forced(tmp_path, capsys):
    run = tmp_path / "run"
    assert main(["slurm", "submit", "digits", f"run.dir={run}", "slurm.nodes=3", "slurm.gpus_per_node=2"]) == 2
    err = capsys.readouterr().err
    assert "ERROR" in err and "not submitted" in err and "--force" in err
    assert not (run / "slurm").exists()


def test_slurm_commands_without_slurm_say_so(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("PATH", str(tmp_path))
    assert main(["slurm", "status", "77"]) == 2
    assert "'scontrol' was not found" in capsys.readouterr().err


def test_check_exit_code(capsys):
    assert main(["slurm", "check", "digits", "run.dir=/tmp/x", "slurm.nodes=3", "slurm.gpus_per_node=2"]) == 1
    assert "1 error(s)" in capsys.readouterr().err


def test_notes_are_counted_apart_from_warnings(tmp_path, capsys):
    from hpctrain.data.shards import write_split
    from tests.unit.test_shards import _samples

    for split in ("train", "test"):
        write_split(tmp_path / "set" / split, split, _samples(4), max_bytes=6_000)
    assert main(["slurm", "check", "tests.shard_experiment:ShardClassifier", f"run.dir={tmp_path / 'run'}",
                 f"model.shards={tmp_path / 'set'}", "data.stage_dir=$SLURM_TMPDIR", "ckpt.every_minutes=30"]) == 0
    err = capsys.readouterr().err
    assert "INFO    data.stage_dir: $SLURM_TMPDIR is set per node and job" in err
    # and the partition checks' note where sinfo cannot answer here (no controller during the unit tests)
    notes = 1 + ("INFO    slurm.partition: the partition checks" in err)
    assert "hpctrain slurm check: 0 error(s), " in err and f"warning(s), {notes} note(s)" in err


def test_a_bare_interpreter_name_on_path_is_found():
    from hpctrain.slurm.facts import gather_facts

    c = cfg("slurm.python=python3")
    assert "python3" in gather_facts(c, job.job_spec(c), ()).existing


def test_the_lead_time_hint_does_not_trigger_its_own_warning():
    """Below 120 s of job, half the job would be under the 60 s the lead-time check warns about."""
    from hpctrain.slurm.lint import _lead_for

    assert [_lead_for(t) for t in (None, 3600, 200, 90, 61, 30)] == [120, 120, 100, 60, 60, 29]


def test_skipped_partition_checks_are_said():
    _, found = findings(facts=Facts(run_dir_fs="nfs4", existing=frozenset({"/usr/bin/python3"}),
                                    partition_note="sinfo failed: Unable to contact slurm controller"))
    note = [f for f in found if f.key == "slurm.partition"]
    assert note and note[0].level == "info"
    assert note[0].message == ("the partition checks (GPUs, CPUs and memory per node) were skipped: sinfo failed: "
                               "Unable to contact slurm controller")


def test_a_run_dir_that_does_not_exist_is_said_as_such():
    _, found = findings("run.dir=/shared/runs/x", facts=Facts(run_dir_fs="ext4", run_dir_parent="/",
                                                              existing=frozenset({"/usr/bin/python3"})))
    run_dir = [f for f in found if f.key == "run.dir"]
    assert run_dir and run_dir[0].message.startswith("/shared/runs/x does not exist here, nor does /shared")
    assert "ext4" not in run_dir[0].message


def test_a_node_local_working_directory_with_the_experiment_module_is_a_warning():
    facts = Facts(run_dir_fs="nfs4", existing=frozenset({"/usr/bin/python3"}), module_file="/tmp/me/mymodule.py",
                  workdir_fs="tmpfs")
    cfg_ = cfg("slurm.nodes=2", "ckpt.every_minutes=30")
    spec = dataclasses.replace(job.job_spec(cfg_), python="/usr/bin/python3", venv="", workdir="/tmp/me")
    found = [f for f in lint(cfg_, spec, facts) if f.key == "experiment"]
    assert found and "the job will cd into /tmp/me and import /tmp/me/mymodule.py" in found[0].message
    assert not [f for f in lint(cfg_, spec, dataclasses.replace(facts, module_file="")) if f.key == "experiment"]


def test_slurm_status_and_cancel_start_without_importing_torch():
    """A preemption script or a user's `hpctrain slurm cancel` should act at once: torch's import is ~2 s of CPU here
    (the real-Slurm preemption test once signalled its job too late on a loaded machine because of it)."""
    import subprocess
    import sys

    code = "import sys, hpctrain.cli, hpctrain.commands.slurm, hpctrain.monitor.report; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"
