# `make run` trains the default model on the bundled corpus; `make test` runs the test suite.
# Both create .venv on first use. torch is pinned here (a CPU build on CPU machines) and kept
# as `torch>=2.6` in pyproject.toml, so pip never swaps in a different build.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
TORCH_VERSION ?= 2.13.0

.PHONY: run test setup clean bench

# One line per step, said before it starts: pip runs quietly (-q: its warnings and errors still show), and the whole
# set-up takes minutes on a fresh machine (torch is the largest download).
$(STAMP): pyproject.toml
	@echo "setup 1/4: the virtual environment $(VENV) ($(PYTHON) -m venv)"
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@echo "setup 2/4: an up-to-date pip"
	@$(PY) -m pip install -q --upgrade pip
	@echo "setup 3/4: torch $(TORCH_VERSION) (the largest download and the longest step: a few minutes on a slow link)"
	@$(PY) -m pip install -q "torch==$(TORCH_VERSION)"
	@echo "setup 4/4: paratrain and its dependencies, with the dev extras (pip install -e '.[dev]')"
	@$(PY) -m pip install -q -e ".[dev]"
	@touch $(STAMP)
	@echo "setup done: $(VENV) (made again when pyproject.toml changes)"

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
