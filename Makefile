# Two entry points (see README): `make demo` and `make test`. Both install into .venv first.
VENV ?= .venv
PY := $(VENV)/bin/python
# The torch build pip resolves on this project's machines (a CUDA build; runs on CPU too).
# Override on a cluster to match its CUDA, e.g. make TORCH_SPEC='torch==2.5.1' test
TORCH_SPEC ?= torch==2.14.1 torchvision==0.29.1
# (not PIP_QUIET: pip reads that name from the environment itself)
PIPFLAGS ?= -q

.PHONY: setup slurm-deps fuse-deps demo test test-unit test-dist test-slurm test-floor clean-runs gpu-check gpu-check-quick

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml Makefile
	python3 -m venv $(VENV)
	$(PY) -m pip install $(PIPFLAGS) $(TORCH_SPEC)
	$(PY) -m pip install $(PIPFLAGS) -e '.[dev]'
	touch $@

# The supported floor (compat.TORCH_FLOOR, what GPU images shipped in 2026-11) in a venv of its own.
FLOOR_VENV ?= .venv-floor
FLOOR_TORCH_SPEC ?= torch==2.11.0 torchvision==0.26.0

$(FLOOR_VENV)/.installed: pyproject.toml Makefile
	python3 -m venv $(FLOOR_VENV)
	$(FLOOR_VENV)/bin/python -m pip install $(PIPFLAGS) $(FLOOR_TORCH_SPEC)
	$(FLOOR_VENV)/bin/python -m pip install $(PIPFLAGS) -e '.[dev]'
	touch $@

demo: setup
	$(VENV)/bin/hpctrain train digits --nproc-per-node 2 run.dir=runs/demo-$$(date +%Y%m%d-%H%M%S)

# The Slurm tier runs a real two-node cluster (tests/slurm); as root, install Debian's Slurm if missing.
# Without root the tier is skipped with the reason.
SLURM_PKGS := slurmd slurmctld slurm-client munge iproute2
slurm-deps:
	@if [ "$$(id -u)" = 0 ] && ! command -v slurmctld > /dev/null 2>&1 && ! [ -x /usr/sbin/slurmctld ]; then \
	  echo "installing $(SLURM_PKGS) for the Slurm tests"; \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $(SLURM_PKGS) > /dev/null; \
	fi

# The slow FUSE file system (tools/slowfs.py) of tests/unit/test_slowfs.py and benchmarks/data_throughput.py --fs slow
# needs libfuse 3 and fusermount3; as root, install Debian's fuse3 if missing. Without root or /dev/fuse those tests
# are skipped.
fuse-deps:
	@if [ "$$(id -u)" = 0 ] && ! command -v fusermount3 > /dev/null 2>&1; then \
	  echo "installing fuse3 for the slow-file-system tests"; \
	  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends --no-remove fuse3 > /dev/null) \
	    || echo "warning: fuse3 could not be installed; the slow-file-system tests will be skipped"; \
	fi

# Byte-compiled first: with PYTHONDONTWRITEBYTECODE set (as on this project's VMs) every process of every launch
# would compile the package's sources again (about 0.3 s of CPU a process, four processes a launch).
# Two pytest workers (pytest-xdist), each test module on one of them (--dist loadscope: a module's shared runs are
# made once). A launch leaves a core idle while one process imports torch, and the Slurm tests mostly wait for the
# scheduler: the other worker's tests fill that time (measured in BENCHMARKS.md, "The test suite's wall time").
# The last line gives the whole command's time (both tiers), so a change that breaks the budget shows in its log.
PYTEST_PARALLEL ?= -n 2 --dist loadscope
test: setup slurm-deps fuse-deps
	@start=$$(date +%s); $(PY) -m compileall -q src tests \
	  && $(PY) -m pytest $(PYTEST_PARALLEL) && $(MAKE) --no-print-directory test-floor; rc=$$?; \
	  echo "make test: $$(( $$(date +%s) - start )) s for both tiers (exit $$rc)"; exit $$rc

# The unit tier and the two-process smoke test on the floor torch (about 2 minutes plus its install).
test-floor: $(FLOOR_VENV)/.installed fuse-deps
	$(FLOOR_VENV)/bin/python -m pytest $(PYTEST_PARALLEL) tests/unit tests/dist/test_async_resume.py

test-unit: setup fuse-deps
	$(PY) -m pytest tests/unit

test-dist: setup
	$(PY) -m pytest tests/dist

test-slurm: setup slurm-deps
	$(PY) -m pytest tests/slurm

# Everything only a GPU shows (tests/gpu, 1 and 2 processes, the overhead, checkpoint and pre-flight benchmarks on
# the GPU), under 20 minutes on one H100, into one folder with a summary table; without CUDA every stage is skipped.
# make gpu-check GPU_CHECK_DIR=path GPU_CHECK_ARGS='--only tests-gpu,doctor-perf'
GPU_CHECK_DIR ?=
GPU_CHECK_ARGS ?=
gpu-check: setup
	$(PY) tools/gpu_check.py $(if $(GPU_CHECK_DIR),--out '$(GPU_CHECK_DIR)') $(GPU_CHECK_ARGS)

# The quick check for a short allocation (at most 8 minutes on one H100, compilation included), from the source tree
# with the node's own torch: no venv, no network (docs/gpu.md says what to carry).
gpu-check-quick:
	PYTHONPATH=src:.$${PYTHONPATH:+:$$PYTHONPATH} python3 tools/gpu_check.py --quick $(if $(GPU_CHECK_DIR),--out '$(GPU_CHECK_DIR)') $(GPU_CHECK_ARGS)
