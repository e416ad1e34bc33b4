"""GPU-path decisions made on the host, tested on CPU with a monkeypatched torch.cuda: device binding,
precision choice, the stop vote's placement, the model wrapping order."""

from __future__ import annotations

import contextlib

import pytest
import torch

from hpctrain.dist.env import LaunchInfo
from hpctrain.dist.runtime import choose_device
from hpctrain.errors import UserError
from hpctrain.train.precision import resolve_precision


def launch(local_rank: int, local_world: int) -> LaunchInfo:
    return LaunchInfo(rank=local_rank, world_size=local_world, local_rank=local_rank, local_world_size=local_world,
                      node_rank=0, num_nodes=1, master_addr="127.0.0.1", master_port=0, hostname="node7",
                      job_id="", launcher="srun")


@pytest.fixture
def gpus(monkeypatch):
    def visible(count: int) -> None:
        monkeypatch.setattr(torch.cuda, "is_available", lambda: count > 0)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
    return visible


@pytest.mark.parametrize("local_rank", [0, 1, 3])
def test_one_visible_gpu_per_task_is_cuda_0_for_every_local_rank(gpus, local_rank):
    gpus(1)  # srun --gpus-per-task=1 / --gpu-bind=single:1 / CUDA_VISIBLE_DEVICES per task
    assert choose_device(launch(local_rank, 4)) == torch.device("cuda", 0)


@pytest.mark.parametrize("local_rank", [0, 1, 3])
def test_all_gpus_visible_is_cuda_local_rank(gpus, local_rank):
    gpus(4)
    assert choose_device(launch(local_rank, 4)) == torch.device("cuda", local_rank)
    gpus(8)  # fewer processes than GPUs: still one each
    assert choose_device(launch(local_rank, 4)) == torch.device("cuda", local_rank)


def test_some_but_not_all_gpus_visible_is_a_clear_error(gpus):
    gpus(2)
    with pytest.raises(UserError) as err:
        choose_device(launch(3, 4))
    assert "local rank 3 of 4 on node7 sees 2 GPUs" in str(err.value)
    assert "either one GPU (its own) or all of the node's" in str(err.value)


def test_no_gpu_is_the_cpu(gpus):
    gpus(0)
    assert choose_device(launch(1, 2)) == torch.device("cpu")


@pytest.mark.parametrize("native, emulated, expected", [
    (True, True, "bf16"),    # Ampere, Hopper
    (False, True, "fp16"),   # V100, T4: bf16 only emulated (slower than fp32)
    (False, False, "fp16"),
])
def test_auto_precision_is_bf16_only_where_native(monkeypatch, native, emulated, expected):
    def supported(including_emulation: bool = True) -> bool:
        return native or (including_emulation and emulated)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", supported)
    monkeypatch.setattr(torch.cuda, "device", lambda d: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    p = resolve_precision("auto", torch.device("cuda", 0))
    assert p.name == expected
    assert p.dtype == {"bf16": torch.bfloat16, "fp16": torch.float16}[expected]
    # fp16 needs loss scaling: the scaler is on exactly then.
    assert p.build_scaler().is_enabled() == (expected == "fp16")


def test_auto_precision_on_cpu_is_fp32():
    p = resolve_precision("auto", torch.device("cpu"))
    assert p.name == "fp32" and p.dtype is None


@pytest.fixture
def one_process_group(tmp_path):
    """A real gloo group of one process, so DDP can be built in a unit test."""
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_compiled_ddp_is_compile_around_ddp(one_process_group, monkeypatch):
    """torch's order for compiled DDP: DDP inside, torch.compile outside, so dynamo's DDPOptimizer splits the
    graph at bucket boundaries and the all-reduces overlap the backward."""
    import dataclasses

    from torch import nn
    from torch.nn.parallel import DistributedDataParallel as DDP

    from hpctrain.config.load import load_config
    from hpctrain.dist.runtime import single_process_runtime
    from hpctrain.dist.wrap import ddp_of, unwrap_model, wrap_model
    from hpctrain.experiments.digits import DigitsExperiment, DigitsOptions

    cfg = load_config("digits", DigitsOptions, experiment_defaults=DigitsExperiment.defaults,
                      overrides=["train.compile=true"])
    runtime = dataclasses.replace(single_process_runtime(torch.device("cpu")), world_size=2)  # 'distributed'
    module = nn.Linear(4, 2)
    wrapped = wrap_model(module, cfg, runtime)
    assert isinstance(wrapped, torch._dynamo.eval_frame.OptimizedModule)
    assert isinstance(wrapped._orig_mod, DDP)
    assert ddp_of(wrapped) is wrapped._orig_mod
    assert unwrap_model(wrapped) is module
    assert torch._dynamo.config.optimize_ddp  # the graph split at bucket boundaries is on


def _node_launch(node: int, local_rank: int, local_world: int, nodes: int) -> LaunchInfo:
    return LaunchInfo(rank=node * local_world + local_rank, world_size=nodes * local_world, local_rank=local_rank,
                      local_world_size=local_world, node_rank=node, num_nodes=nodes, master_addr="127.0.0.1",
                      master_port=0, hostname=f"n{node}", job_id="", launcher="srun")


def _exchange_on_threads(uuids: dict[tuple[int, int], str], nodes: int, local_world: int, monkeypatch) -> list:
    """Every (node, local rank) runs shared_gpus on its own thread against one in-memory store, as the ranks of a
    job do against the rendezvous store; returns each rank's answer (or the exception it raised)."""
    import threading

    from hpctrain.dist import gpu_identity

    mine = threading.local()
    monkeypatch.setattr(gpu_identity, "device_identity", lambda device: mine.uuid)
    store = torch.distributed.HashStore()
    answers: dict[tuple[int, int], list[str]] = {}

    def rank(node: int, local_rank: int) -> None:
        mine.uuid = uuids[node, local_rank]
        try:
            answers[node, local_rank] = gpu_identity.shared_gpus(
                store, _node_launch(node, local_rank, local_world, nodes), torch.device("cuda", 0), timeout_s=30)
        except Exception as err:  # the same refusal on every rank is what some tests expect
            answers[node, local_rank] = err

    threads = [threading.Thread(target=rank, args=key) for key in uuids]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert len(answers) == len(uuids), "a rank did not finish its exchange"
    return [answers[key] for key in sorted(answers)]


def test_ranks_of_a_node_sharing_a_gpu_are_found_through_the_store_by_every_rank(monkeypatch):
    """Decided from the GPUs' UUIDs, not from CUDA_VISIBLE_DEVICES (Slurm sets 0 in every task of a one-GPU node,
    bound or not): node n0's two tasks see the same GPU, n1's each their own. Every rank of both nodes gets the same
    verdict, so all choose the same backend."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    uuids = {(0, 0): "GPU-aaaa1111", (0, 1): "GPU-aaaa1111", (1, 0): "GPU-bbbb0000", (1, 1): "GPU-bbbb1111"}
    answers = _exchange_on_threads(uuids, nodes=2, local_world=2, monkeypatch=monkeypatch)
    expected = ["on node n0, local ranks 0, 1 use the same GPU (GPU-aaaa1111) (CUDA_VISIBLE_DEVICES=0 there)"]
    assert answers == [expected] * 4


def test_ranks_with_a_gpu_each_share_nothing_even_when_each_sees_it_as_cuda_0(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")  # srun --gpus-per-task=1: every task's one GPU is its cuda:0
    uuids = {(0, i): f"GPU-{i}{i}{i}" for i in range(4)}
    assert _exchange_on_threads(uuids, nodes=1, local_world=4, monkeypatch=monkeypatch) == [[]] * 4


def test_cpu_ranks_take_part_and_a_job_of_gpu_and_cpu_ranks_is_refused_on_every_rank(monkeypatch):
    """A node whose GPU failed to initialise computes on the CPU: its ranks would pick gloo while the others pick
    NCCL, and wait for each other until the timeout. Every rank takes part in the exchange and all refuse, naming
    where the CPU ranks are; a job all on CPUs passes with nothing shared."""
    from hpctrain.errors import UserError

    all_cpu = {(n, i): "cpu" for n in range(2) for i in range(2)}
    assert _exchange_on_threads(all_cpu, nodes=2, local_world=2, monkeypatch=monkeypatch) == [[]] * 4
    mixed = {(0, 0): "GPU-a", (0, 1): "GPU-b", (1, 0): "GPU-c", (1, 1): "cpu"}
    answers = _exchange_on_threads(mixed, nodes=2, local_world=2, monkeypatch=monkeypatch)
    assert all(isinstance(a, UserError) for a in answers), answers
    assert "on the CPU are n1 (local ranks 1)" in str(answers[0])


def test_a_rank_that_never_reports_is_a_message_naming_it_not_a_silent_wait():
    from hpctrain.dist.gpu_identity import exchange
    from hpctrain.errors import UserError

    store = torch.distributed.HashStore()
    with pytest.raises(UserError) as err:
        exchange(store, _node_launch(0, 0, 2, 1), "GPU-a", timeout_s=0.5)  # local rank 1 never comes
    assert "did not all report their device within dist.timeout_s=0.5 s (missing: 1;" in str(err.value)


def test_the_backend_follows_what_the_ranks_found():
    from hpctrain.dist.runtime import choose_backend

    found = ["on node n0, local ranks 0, 1 use the same GPU (GPU-aaaa1111)"]
    assert choose_backend("auto", True, found) == "gloo"
    assert choose_backend("auto", True, []) == "nccl"
    assert choose_backend("auto", False, []) == "gloo"
    with pytest.raises(UserError) as err:
        choose_backend("nccl", True, found)
    assert "on node n0, local ranks 0, 1 use the same GPU (GPU-aaaa1111): NCCL refuses two ranks" in str(err.value)
    assert "--gpus-per-task=1" in err.value.hint and "dist.backend=auto" in err.value.hint
    with pytest.raises(UserError, match="needs CUDA GPUs"):
        choose_backend("nccl", False, [])


def test_gloo_gets_one_exact_interface_from_nccls_prefix_rules():
    """NCCL_SOCKET_IFNAME holds prefixes ('ib' is ib0, ib1), '=' exact names or '^' exclusions; gloo takes one exact
    name, and without one binds to what the hostname resolves to (127.0.1.1 on many images)."""
    from hpctrain.dist.env import gloo_ifname_from_nccl

    nics = {"lo": "127.0.0.1", "eth0": "10.0.0.5", "docker0": "172.17.0.1", "ib0": "10.1.0.5", "ib1": "10.2.0.5"}
    assert gloo_ifname_from_nccl({"NCCL_SOCKET_IFNAME": "ib"}, nics) == "ib0"
    assert gloo_ifname_from_nccl({"NCCL_SOCKET_IFNAME": "=ib1"}, nics) == "ib1"
    assert gloo_ifname_from_nccl({"NCCL_SOCKET_IFNAME": "^lo,docker"}, nics) == "eth0"
    assert gloo_ifname_from_nccl({"NCCL_SOCKET_IFNAME": "ib", "GLOO_SOCKET_IFNAME": "eth0"}, nics) == ""  # the user's
    assert gloo_ifname_from_nccl({"NCCL_SOCKET_IFNAME": "hsn"}, nics) == ""  # no match: doctor reports it
    assert gloo_ifname_from_nccl({}, nics) == ""
    # only interfaces with an address count (an unconfigured eno1 is absent from the map)
    assert gloo_ifname_from_nccl({"NCCL_SOCKET_IFNAME": "en,ib"}, nics) == "ib0"


def test_gloo_prefers_the_interface_that_routes_to_the_master(monkeypatch):
    """'^docker0,lo' also matches a Docker network bridge (br-...), whose address is the same on every node:
    the interface the kernel routes MASTER_ADDR through wins."""
    from hpctrain.dist import env

    nics = {"lo": "127.0.0.1", "br-1a2b": "172.18.0.1", "eth0": "10.0.0.5"}
    monkeypatch.setattr(env, "_source_address", lambda host: "10.0.0.5" if host == "node1" else "")
    assert env.gloo_ifname_from_nccl({"NCCL_SOCKET_IFNAME": "^docker0,lo", "MASTER_ADDR": "node1"}, nics) == "eth0"
    assert env.gloo_ifname_from_nccl({"NCCL_SOCKET_IFNAME": "^docker0,lo"}, nics) == "br-1a2b"  # no master: first
    assert "lo" in env.interface_addresses()  # the real listing works here


def test_the_vote_on_gloo_uses_cpu_tensors_on_the_training_group(monkeypatch):
    """CPU flags on the default (training) group, asynchronously: its dist.timeout_s bounds the wait."""
    import dataclasses

    import torch.distributed as dist

    from hpctrain.dist.runtime import single_process_runtime
    from hpctrain.fault.vote import StepVote, Verdict

    runtime = dataclasses.replace(single_process_runtime(torch.device("cpu")), world_size=2, backend="gloo",
                                  control=object())
    calls = []

    class Work:
        def wait(self):
            calls.append("wait")

    def all_reduce(tensor, op, async_op, group=None):
        calls.append(("all_reduce", tensor.device.type, group, async_op))
        tensor[0] = 15.0  # another rank got SIGTERM
        return Work()

    monkeypatch.setattr(dist, "all_reduce", all_reduce)
    vote = StepVote(runtime)
    vote.cast(0, False)
    assert calls == [("all_reduce", "cpu", None, True)]  # cast does not wait
    assert vote.collect() == Verdict(15, False)
    assert calls[-1] == "wait"
