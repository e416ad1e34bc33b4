# Two entry points (see README): `make demo` and `make test`. Both install into .venv first.
VENV ?= .venv
PY := $(VENV)/bin/python
# The torch build pip resolves on this project's machines (a CUDA build; runs on CPU too).
# Override on a cluster to match its CUDA, e.g. make TORCH_SPEC='torch==2.5.1' test
TORCH_SPEC ?= torch==2.14.1 torchvision==0.29.1
# (not PIP_QUIET: pip reads that name from the environment itself)
PIPFLAGS ?= -q

.PHONY: setup demo test test-unit test-dist clean-runs

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml Makefile
	python3 -m venv $(VENV)
	$(PY) -m pip install $(PIPFLAGS) $(TORCH_SPEC)
	$(PY) -m pip install $(PIPFLAGS) -e '.[dev]'
	touch $@

demo: setup
	$(VENV)/bin/hpctrain train digits --nproc-per-node 2 run.dir=runs/demo-$$(date +%Y%m%d-%H%M%S)

test: setup
	$(PY) -m pytest

test-unit: setup
	$(PY) -m pytest tests/unit

test-dist: setup
	$(PY) -m pytest tests/dist
