# `make run` trains the default model on the bundled corpus; `make test` runs the test suite.
# Both create .venv on first use. torch is pinned here (a CPU build on CPU machines) and kept
# as `torch>=2.6` in pyproject.toml, so pip never swaps in a different build.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
TORCH_VERSION ?= 2.13.0

.PHONY: run test setup clean bench

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "torch==$(TORCH_VERSION)"
	$(PY) -m pip install -q -e ".[dev]"
	touch $(STAMP)

setup: $(STAMP)

run: $(STAMP)
	$(BYTECODE)
	$(VENV)/bin/paratrain train --checkpoint.resume=auto  # a second `make run` continues runs/default

# Two pytest workers (pytest-xdist): each test is one process tree, so two of them fill a 2-core CI machine;
# more workers on a bigger machine would oversubscribe the multi-rank tests (`make test PYTEST_WORKERS=4`).
PYTEST_WORKERS ?= 2

# Bytecode for our own files, written once: with PYTHONDONTWRITEBYTECODE set (as on CI) every process that imports
# the trainer would compile it again (~1 s of CPU each; the suite starts hundreds). Up-to-date files are skipped.
BYTECODE := $(PY) -m compileall -q -j 0 paratrain tests bench >/dev/null

test: $(STAMP)
	$(BYTECODE)
	$(PY) -m pytest -n $(PYTEST_WORKERS)

clean:
	rm -rf $(VENV) runs data/cache
