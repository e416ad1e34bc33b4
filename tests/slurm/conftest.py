"""The two-node Slurm cluster, once per test session; skipped with the reason where it cannot run."""

from __future__ import annotations

import pytest

from tests.slurm.cluster import Cluster, why_not_available


@pytest.fixture(scope="session")
def cluster(tmp_path_factory):
    reason = why_not_available()
    if reason:
        pytest.skip(reason)
    c = Cluster(tmp_path_factory.mktemp("slurm"))
    try:
        c.start()
        yield c
    finally:
        c.stop()
