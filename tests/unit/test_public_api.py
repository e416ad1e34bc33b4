"""The public API users import from `hpctrain` itself (issue 39): each name, lazily, and the docstring's example."""

import doctest
import subprocess
import sys

import hpctrain


def test_each_public_name_imports_from_hpctrain():
    from hpctrain import (  # noqa: F401
        BatchInfo, Datasets, Experiment, Outputs, Step, StepExperiment, __version__, resolve_config, session,
    )

    assert sorted(hpctrain.__all__) == sorted(["__version__", "Experiment", "BatchInfo", "Datasets", "Outputs",
                                               "StepExperiment", "session", "Step", "resolve_config"])
    for name in hpctrain.__all__:
        assert getattr(hpctrain, name) is not None and name in dir(hpctrain)


def test_the_docstring_example_runs():
    result = doctest.testmod(hpctrain, raise_on_error=False)
    assert result.attempted >= 3 and result.failed == 0


def test_import_hpctrain_stays_light():
    code = "import sys, hpctrain; print('torch' in sys.modules, hpctrain.__version__)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out == ["False", hpctrain.__version__]
