# The two commands of the README: `make demo` and `make test`. Each does its own set-up.
# Python: PYTHON=/path/to/python chooses; else the newest of python3.13, python3.12, python3.11
# and python3 that is 3.11 or newer.
PYTHON ?= $(shell for p in python3.13 python3.12 python3.11 python3; do \
	command -v $$p >/dev/null 2>&1 && $$p -c 'import sys; sys.exit(sys.version_info < (3, 11))' \
	2>/dev/null && { echo $$p; break; }; done)
VENV := .venv
PY := $(VENV)/bin/python
# pip shows what it downloads (torch alone is hundreds of MB): no -q. The venv has no pip of its
# own (ensurepip costs 6 s): the Python that made it installs into it (pip --python), or, where
# that pip cannot (none, or older than 22.3), the venv's own pip, which ensurepip then gives it.
PIP := $$(test -x $(VENV)/bin/pip && echo $(PY) -m pip || echo $(PYTHON) -m pip --python $(PY)) \
	install --disable-pip-version-check --progress-bar on -c constraints.txt
# torch's ~15000 modules are byte-compiled apart from pip (which compiles one at a time: 28 of
# the 40 s torch's install takes on 2 cores), on every core, while what comes next is resolved
# (which waits on the network). compileall writes even where PYTHONDONTWRITEBYTECODE is set (as on
# these machines): no rank or daemon compiles torch, or ftd itself (`make test`), again.
PIP_NO_COMPILE := $(PIP) --no-compile
PURELIB = "$$($(PY) -c 'import sysconfig; print(sysconfig.get_path("purelib"))')"
COMPILE := $(PY) -m compileall -q -q -j 0
# ftd itself is built by the venv's setuptools (torch brings one) where it is recent enough: a
# build in isolation first installs setuptools into a throwaway environment (10-15 s).
EDITABLE = $$($(PY) -c 'import setuptools, sys; sys.exit(int(setuptools.__version__.split(".")[0]) < 71)' 2>/dev/null && echo --no-build-isolation) -e
VENV_STAMP := $(VENV)/.created
# ftd and what it needs (the test tools: ~70 packages) are installed by uv where it can be
# installed: it asks the index for them all at once, where pip resolves them one after another (a
# round trip each: 35 of the 54 s pip took, against uv's 12 s, bytecode included). torch stays
# pip's: pip finds it where this machine's pip configuration points, uv does not. Without uv, or
# where it fails (an index only pip's configuration names), pip as before.
UV := $(VENV)/bin/uv
COMMA := ,
INSTALL_PROJECT = { { test -x $(UV) || $(PIP) uv; } \
	&& $(UV) pip install --python $(PY) -c constraints.txt --compile-bytecode -e $(1); } \
	|| $(PIP) $(EDITABLE) $(1)
TORCH_STAMP := $(VENV)/.torch
DEMO_STAMP := $(VENV)/.demo
STAMP := $(VENV)/.installed

# Which torch build: PyPI's torch for Linux is the CUDA build (gigabytes of CUDA libraries a
# machine without a GPU never uses), so without an NVIDIA GPU (`nvidia-smi -L` lists none) the CPU
# build comes from PyTorch's CPU index. Where that index cannot be reached (a machine that
# reaches only PyPI or a mirror), pip's own configuration chooses, as it did before.
# `make TORCH_INDEX=URL ...` names another index; `make TORCH_INDEX= ...` takes PyPI's default.
TORCH_CPU_INDEX := https://download.pytorch.org/whl/cpu
GPU := $(shell nvidia-smi -L 2>/dev/null | head -n 1)
TORCH_INDEX ?= $(if $(GPU),,$(TORCH_CPU_INDEX))

.PHONY: demo test lint typecheck unit fuzz-long bench-check clean

$(VENV_STAMP):
	@test -n "$(PYTHON)" || { echo "no Python 3.11+ found: install one, or run make PYTHON=/path/to/python3.11"; exit 1; }
	@echo "=== creating $(VENV) with $(PYTHON) ($$($(PYTHON) --version)) ==="
	$(PYTHON) -m venv --without-pip $(VENV)
	$(PYTHON) -m pip --python $(PY) --version > /dev/null 2>&1 || $(PY) -m ensurepip --default-pip
	touch $(VENV_STAMP)

# torch 2.13.0 (constraints.txt) and numpy, without which torch prints "Failed to initialize
# NumPy" at every import (each daemon start, each rank).
$(TORCH_STAMP): $(VENV_STAMP) constraints.txt
ifeq ($(TORCH_INDEX),)
	@echo "=== installing torch 2.13.0 ($(if $(GPU),an NVIDIA GPU is here,TORCH_INDEX is empty): PyPI's default build, CUDA on Linux) and numpy into $(VENV): a few minutes the first time ==="
	$(PIP_NO_COMPILE) torch numpy
else
	@echo "=== installing torch 2.13.0 ($(if $(GPU),from $(TORCH_INDEX),CPU build: no NVIDIA GPU here)) and numpy from $(TORCH_INDEX) into $(VENV): a few minutes the first time ==="
	if $(PY) -c 'import sys, urllib.request; urllib.request.urlopen(sys.argv[1], timeout=10)' \
		'$(TORCH_INDEX)/torch/' 2>/dev/null; then \
		$(PIP_NO_COMPILE) --index-url '$(TORCH_INDEX)' torch numpy; \
	else \
		echo "$(TORCH_INDEX) cannot be reached from here: torch and numpy from pip's configured indexes instead (see pip config list)"; \
		$(PIP_NO_COMPILE) torch numpy; \
	fi
endif
	touch $(TORCH_STAMP)

# What the demo needs: ftd, torch and numpy.
$(DEMO_STAMP): $(TORCH_STAMP) pyproject.toml constraints.txt
	@echo "=== installing ftd into $(VENV) ==="
	$(COMPILE) $(PURELIB)/torch $(PURELIB)/numpy > /dev/null 2>&1 & compiling=$$!; \
	$(call INSTALL_PROJECT,.); installed=$$?; wait $$compiling; exit $$installed
	$(COMPILE) ftd client || true
	touch $(DEMO_STAMP)

# What the tests need, in one install after torch's: ftd, the test tools and NVIDIA's
# nvidia-resiliency-ext (for the drop-in tests); where the latter cannot be installed, the rest
# without it, and its tests skip.
$(STAMP): $(TORCH_STAMP) pyproject.toml constraints.txt
	@echo "=== installing ftd, the test tools and nvidia-resiliency-ext into $(VENV): a few minutes the first time ==="
	$(COMPILE) $(PURELIB)/torch $(PURELIB)/numpy > /dev/null 2>&1 & compiling=$$!; \
	$(call INSTALL_PROJECT,'.[test$(COMMA)nvrx]') \
		|| { echo "nvidia-resiliency-ext not installed: its tests in tests/health/nvrx/test_nvrx_compat.py are skipped"; \
		     $(call INSTALL_PROJECT,'.[test]'); }; \
		installed=$$?; wait $$compiling; exit $$installed
	touch $(STAMP)

# The main job: examples/train_ddp.py under `ftd serve` on 2 ranks. Rank 1 crashes at step 25 of
# the first attempt; ftd restarts the group and training resumes from the step-20 checkpoint.
# Then rank 1 hangs at step 25: the hang detector dumps its stacks, kills it and restarts again.
DEMO_DIR := runs/demo
demo: $(DEMO_STAMP)
	rm -rf $(DEMO_DIR)
	@echo "=== 1/2: a crash at step 25, restart, resume from the newest checkpoint ==="
	$(VENV)/bin/ftd serve --standalone --nproc-per-node 2 --max-restarts 3 --api-port 0 \
		--log-dir $(DEMO_DIR)/logs --run-id crash \
		--ft-param-rank_heartbeat_timeout=30 --ft-param-rank_section_timeouts=setup:120,step:10 \
		examples/train_ddp.py --steps 60 --crash-at-step 25 --ckpt-dir $(DEMO_DIR)/ckpt-crash
	@echo "=== 2/2: a hang at step 25, detected by its heartbeat timeout, restart, resume ==="
	$(VENV)/bin/ftd serve --standalone --nproc-per-node 2 --max-restarts 3 --api-port 0 \
		--log-dir $(DEMO_DIR)/logs --run-id hang \
		--ft-param-rank_heartbeat_timeout=3 --ft-param-rank_section_timeouts=setup:120,step:10 \
		examples/train_ddp.py --steps 60 --hang-at-step 25 --ckpt-dir $(DEMO_DIR)/ckpt-hang
	@echo "=== logs, events and stacks: $(DEMO_DIR)/logs/{crash,hang}/ ==="

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/lint-imports --no-cache

typecheck: $(STAMP)
	$(VENV)/bin/mypy

# Three tests at a time: most of a test is waiting on real daemons and ranks; on 2 cores three
# keep both busy (the whole suite ~8 min). Since stop 38 many tests run several daemons (three
# nodes, ten ranks a node, NVRx releases): under that contention a timing-bound test failed now
# and then in clean clones (a different one each run, each passing alone and beside two CPU
# hogs), so a failed test gets one more try (--reruns 1); one that fails twice fails. Which
# needed its second try is named in the report (-rR: "RERUN"), with the traceback of the try
# that failed (--rerun-show-tracebacks): a test to make robust, not to forget.
# PYTEST_WORKERS=0 runs them one after another.
PYTEST_WORKERS ?= 3
PYTEST := $(VENV)/bin/pytest -q -p no:cacheprovider -n $(PYTEST_WORKERS) --dist worksteal --reruns 1 --rerun-show-tracebacks -rR $(PYTEST_ARGS)
unit: $(STAMP)
	$(PYTEST)

# mypy runs beside the tests (they wait on real processes more than they compute: its 15 s
# cost them a few); its report follows theirs, and either's failure fails `make test`.
MYPY_LOG := $(VENV)/mypy.log
test: lint
	@$(COMPILE) ftd client tests || true
	@echo "=== the tests, with mypy beside them (its report follows) ==="
	( $(VENV)/bin/mypy > $(MYPY_LOG) 2>&1; echo $$? > $(MYPY_LOG).rc ) & \
	$(PYTEST); tests=$$?; wait; \
	echo "$(VENV)/bin/mypy"; cat $(MYPY_LOG); mypy=$$(cat $(MYPY_LOG).rc); \
	exit $$(( tests ? tests : mypy ))

# The fuzz targets' long run (docs/security.md): every decoder's targets for FUZZ_SECONDS
# (ten minutes) in all, rounds of 1000 fresh inputs, two decoders at a time; a line per target
# in runs/fuzz-long.jsonl. `make test` runs their short pass.
FUZZ_SECONDS ?= 600
FUZZ_REPORT := runs/fuzz-long.jsonl
fuzz-long: $(STAMP)
	mkdir -p runs && rm -f $(FUZZ_REPORT)
	FTD_FUZZ_SECONDS=$(FUZZ_SECONDS) FTD_FUZZ_EXAMPLES=1000 FTD_FUZZ_REPORT=$(FUZZ_REPORT) \
		$(VENV)/bin/pytest -q -p no:cacheprovider -n 2 --timeout 0 -m fuzz
	cat $(FUZZ_REPORT)

# The performance budget against torchrun (bench/budget.py; bench/BENCHMARKS.md, "Performance
# budget"): ~3 minutes of real runs, so never part of `make test`; it fails when a ratio is past
# its budget. BENCH_ARGS=--quick for the short configuration (~1 minute).
BENCH_JSON := runs/bench-check.json
bench-check: $(STAMP)
	mkdir -p runs
	PYTHONPATH=.:client $(PY) bench/budget.py --json $(BENCH_JSON) $(BENCH_ARGS)

clean:
	rm -rf $(VENV) .mypy_cache .ruff_cache
