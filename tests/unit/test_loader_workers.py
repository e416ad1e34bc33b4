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
    import os
    import subprocess
    import sys

    (tmp_path / "probe_dataset.py").write_text(PROBE_DATASET)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")]))}
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split()[-2:] == ["[1,", "1]"], out.stdout  # the helper has torch; the helper is not the rank
