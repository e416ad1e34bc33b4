"""data.num_workers=-1 chooses by what the data set is, and the loader-bound warning's advice matches it: worker
processes help a data set that reads and decodes, and slow down one in memory (measured 6.8 s vs 2.0 s an epoch)."""

import dataclasses

import torch
from torch.utils.data import ConcatDataset, Dataset, Subset, TensorDataset

from hpctrain.config.schema import DataSection
from hpctrain.data.loader import auto_workers, build_loader, in_memory
from hpctrain.dist.runtime import single_process_runtime
from hpctrain.train.loop import loader_advice

RUNTIME = single_process_runtime(torch.device("cpu"))


class Files(Dataset):
    def __len__(self):
        return 8

    def __getitem__(self, i):
        return torch.zeros(2), 0


def test_in_memory_data_sets_get_no_workers():
    tensors = TensorDataset(torch.zeros(8, 2))
    assert in_memory(tensors) and in_memory(Subset(tensors, [0, 1])) and in_memory(ConcatDataset([tensors, tensors]))
    assert not in_memory(Files()) and not in_memory(ConcatDataset([tensors, Files()]))
    assert auto_workers(RUNTIME, tensors) == 0
    assert auto_workers(RUNTIME, Files()) == auto_workers(RUNTIME)


def test_the_loader_bound_advice_fits_the_data_set():
    memory, files = TensorDataset(torch.zeros(8, 2)), Files()
    batches = [[0, 1], [2, 3]]
    advice = loader_advice(build_loader(memory, batches, dataclasses.replace(DataSection(), num_workers=2), RUNTIME))
    assert advice.startswith("The data set is in memory and data.num_workers=2: set data.num_workers=0")
    advice = loader_advice(build_loader(memory, batches, dataclasses.replace(DataSection(), num_workers=0), RUNTIME))
    assert advice.startswith("The data set is in memory: the per-batch work is the transform's")
    advice = loader_advice(build_loader(files, batches, dataclasses.replace(DataSection(), num_workers=1), RUNTIME))
    assert advice.startswith("With data.num_workers=1: raise it")


def test_an_in_memory_set_with_augmentation_keeps_its_workers_on_a_gpu():
    """DDPM's CIFAR-10 is a TensorDataset with per-sample flips: on a GPU node the workers run the flips beside the
    GPU's step; on a CPU they would take the cores the model computes on."""
    memory = TensorDataset(torch.zeros(8, 2))
    on_gpu = dataclasses.replace(RUNTIME, device=torch.device("cuda", 0))
    assert auto_workers(on_gpu, memory, transform=lambda s, g: s) == auto_workers(on_gpu)
    assert auto_workers(on_gpu, memory) == 0 and auto_workers(RUNTIME, memory, transform=lambda s, g: s) == 0


def test_data_on_device_gets_advice_about_the_device_not_workers():
    class DeviceLoader:  # data.on_device: no workers, no dataset attribute
        pass

    assert loader_advice(DeviceLoader()).startswith("With data.on_device=true the batches are cut on the device")


PROBE_DATASET = """
import os
import torch
from torch.utils.data import Dataset

class HelperHasTorch(Dataset):
    def __init__(self):
        self.rank_pid = os.getpid()

    def __len__(self):
        return 2

    def __getitem__(self, i):
        maps = open(f"/proc/{os.getppid()}/maps").read()
        return torch.tensor([int("libtorch_cpu" in maps), int(os.getppid() != self.rank_pid)])
"""

PROBE = """
import dataclasses, torch
from hpctrain.config.schema import DataSection
from hpctrain.data.loader import build_loader
from hpctrain.dist.runtime import single_process_runtime
from probe_dataset import HelperHasTorch

cfg = dataclasses.replace(DataSection(), num_workers=1, worker_start="forkserver")
loader = build_loader(HelperHasTorch(), [[0, 1]], cfg, single_process_runtime(torch.device("cpu")))
print(next(iter(loader))[0].tolist())
"""


def test_forkserver_workers_start_from_a_helper_that_has_imported_torch(tmp_path):
    """Each worker forked from the helper finds torch loaded (libtorch mapped in its parent, the helper) instead of
    importing it again. A fresh interpreter: a forkserver already running in this one keeps its old preload."""
    out = _run_script(tmp_path, {"probe_dataset": PROBE_DATASET}, PROBE)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split()[-2:] == ["[1,", "1]"], out.stdout  # the helper has torch; the helper is not the rank


SPEECH_DATA = """
import torch

def utterances(n, requires_grad=False):  # speech's natural form: one 1-D tensor per utterance, each its own length
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(5, 60, (n,), generator=g)
    return [torch.randn(int(k), generator=g).requires_grad_(requires_grad) for k in lengths]

def pad(samples):
    out = torch.zeros(len(samples), max(len(x) for x in samples))
    for i, x in enumerate(samples):
        out[i, :len(x)] = x.detach()
    return out
"""

SPEECH = """
import os, sys, torch
from torch.utils.data import BatchSampler, SequentialSampler
from hpctrain.config.schema import DataSection
from hpctrain.data.loader import build_loader
from hpctrain.dist.runtime import single_process_runtime
from hpctrain.errors import UserError
from speech_data import pad, utterances

data = utterances(int(sys.argv[1]), requires_grad=sys.argv[2] == "grad")
batches = lambda workers: list(build_loader(data, BatchSampler(SequentialSampler(data), 16, False),
                                            DataSection(num_workers=workers, worker_start="forkserver"),
                                            single_process_runtime(torch.device("cpu")), collate_fn=pad))
try:
    with_workers = batches(2)
except UserError as err:
    sys.exit(f"UserError: {err}")
assert all(torch.equal(a, b) for a, b in zip(with_workers, batches(0))) and len(with_workers) == -(-len(data) // 16)
print("equal", len(os.listdir("/proc/self/fd")))
"""


def _run_script(tmp_path, modules: dict[str, str], script: str, *args: str):
    """``script`` in a fresh interpreter (its own forkserver), with ``modules`` importable by the workers too."""
    import os
    import subprocess
    import sys

    for name, text in modules.items():
        (tmp_path / f"{name}.py").write_text(text)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")]))}
    return subprocess.run([sys.executable, "-c", script, *args], capture_output=True, text=True, timeout=300, env=env)


def _run_speech(tmp_path, *args: str):
    return _run_script(tmp_path, {"speech_data": SPEECH_DATA}, SPEECH, *args)


def test_a_list_of_many_variable_length_tensors_reaches_the_workers(tmp_path):
    """torch sends each tensor's storage to a worker as a file descriptor, and forkserver passes at most 253 in a
    start ('ValueError: too many fds'): 1,000 utterances go as one shared block, and the batches are those made
    without workers."""
    out = _run_speech(tmp_path, "1000", "plain")
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split()[0] == "equal" and int(out.stdout.split()[1]) < 100  # not one open fd per tensor


def test_tensors_that_cannot_be_packed_stop_with_what_to_do(tmp_path):
    out = _run_speech(tmp_path, "400", "grad")  # tensors that need gradients are left to torch: one fd each
    assert out.returncode == 1 and "Traceback" not in out.stderr, out.stderr[-3000:]
    assert "its tensors need more file descriptors than a process start can pass" in out.stderr
    assert "data.num_workers=0" in out.stderr


PARAM_DATA = """
import torch

class Scale(torch.nn.Module):  # a transform holding a parameter: torch sends it as a descriptor of one start
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.full((3,), 2.0))
        self.offset = 0.0

    def forward(self, sample, generator):
        return sample * self.w.detach() + self.offset
"""

PARAM = """
import torch
from hpctrain.config.schema import DataSection
from hpctrain.data.loader import build_loader
from hpctrain.data.sampler import SampleKey
from hpctrain.dist.runtime import single_process_runtime
from param_data import Scale

data = [torch.full((3,), float(i)) for i in range(100)]  # more storages than PACK_ABOVE: packed
scale = Scale()
batches = [[SampleKey(0, i) for i in range(j, j + 10)] for j in range(0, 100, 10)]
loader = build_loader(data, batches, DataSection(num_workers=2, worker_start="forkserver", persistent_workers=False),
                      single_process_runtime(torch.device("cpu")), transform=scale)
assert torch.equal(torch.cat(list(loader)), torch.stack(data) * 2)
data[7].fill_(1000.0)  # between epochs: a sample changed in place, and the transform's setting
scale.offset = 0.5
assert torch.equal(torch.cat(list(loader)), torch.stack(data) * 2 + 0.5)
print("equal")
"""


def test_every_worker_gets_the_data_set_with_a_parameter_as_it_is_at_its_start(tmp_path):
    """A packed data set whose transform holds an nn.Parameter (which torch sends as a descriptor of one process
    start): the second worker got the first start's stale descriptor ('Bad file descriptor', or a dead worker).
    Without persistent workers, each epoch's workers see the data set as it is then: a tensor changed in place in
    the rank (the rank's tensors are views into the shared block) and a changed transform attribute."""
    out = _run_script(tmp_path, {"param_data": PARAM_DATA}, PARAM)
    assert out.returncode == 0 and out.stdout.split()[-1:] == ["equal"], out.stderr[-3000:]


def test_a_list_of_tensors_is_in_memory_and_gets_no_workers_on_a_cpu():
    """data.num_workers=-1 as `config --describe` says: none for an in-memory set on a CPU run; a list of file
    names is read, not indexed."""
    utterances = [(torch.zeros(k), 0) for k in (3, 5, 2)]
    assert in_memory(utterances) and auto_workers(RUNTIME, utterances) == 0
    assert not in_memory(["a.wav", "b.wav"]) and auto_workers(RUNTIME, ["a.wav"]) == auto_workers(RUNTIME)
    on_gpu = dataclasses.replace(RUNTIME, device=torch.device("cuda", 0))
    assert auto_workers(on_gpu, utterances, transform=lambda s, g: s) == auto_workers(on_gpu)
