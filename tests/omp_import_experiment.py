"""A user experiment that does parallel tensor work when its module is imported (loaded as
'omp_import_experiment:OmpAtImport'): the launcher imports it before it starts the workers, so with
OMP_NUM_THREADS > 1 this would start the launcher's OpenMP team, which a forked worker inherits without its
threads (tests/dist/test_fork_safety.py). Its loss runs a parallel op at every step and checks the worker's
intra-op threads; HPCTRAIN_TEST_BLOCK_AT_STEP=K makes rank 0 block every signal at micro-step K and sleep, as a
worker stuck in C code would (a Python handler never runs), after creating the file HPCTRAIN_TEST_BLOCKED_FILE
names."""

from __future__ import annotations

import os
import signal
import time

import torch

from toy_experiment import LinearToy

TABLE = (torch.randn(4_000_000) * 2).sum()  # a module-level parallel op: OpenMP's team starts here if it may


class OmpAtImport(LinearToy):
    calls = 0

    def train_loss(self, model, batch):
        expected = os.environ.get("OMP_NUM_THREADS")
        if expected and torch.get_num_threads() != int(expected):
            raise RuntimeError(f"{torch.get_num_threads()} intra-op threads, OMP_NUM_THREADS={expected}")
        OmpAtImport.calls += 1
        if str(OmpAtImport.calls) == os.environ.get("HPCTRAIN_TEST_BLOCK_AT_STEP") and os.environ.get("RANK") == "0":
            signal.pthread_sigmask(signal.SIG_BLOCK, signal.valid_signals())
            if os.environ.get("HPCTRAIN_TEST_BLOCKED_FILE"):  # the test presses Ctrl-C once rank 0 is stuck
                open(os.environ["HPCTRAIN_TEST_BLOCKED_FILE"], "w").close()
            time.sleep(600)
        big = torch.randn(2_000_000).mul(2).sum() * 0  # parallel: hangs in a worker with a ghost team
        return super().train_loss(model, batch) + big
