# The README's front door: `make demo` and `make test` each set up a virtual
# environment (once) and then run. CONSTRAINTS pins the versions CI uses;
# on a GPU machine install your CUDA torch first and run with CONSTRAINTS=.
PYTHON ?= python3
VENV ?= .venv
CONSTRAINTS ?= constraints.txt
BIN := $(VENV)/bin
STAMP := $(VENV)/.memlm-installed
PIP_C := $(if $(CONSTRAINTS),-c $(CONSTRAINTS),)

.PHONY: setup demo test test-fast lint clean

setup: $(STAMP)

$(STAMP): pyproject.toml $(CONSTRAINTS)
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet $(PIP_C) torch
	$(BIN)/python -m pip install --quiet $(PIP_C) -e '.[dev,lmeval]'
	@touch $(STAMP)

demo: $(STAMP)
	$(BIN)/python -m memlm.launch.demo $(ARGS)

test: $(STAMP)
	$(BIN)/python -m pytest $(ARGS)

test-fast: $(STAMP)
	$(BIN)/python -m pytest -m "not slow" $(ARGS)

lint: $(STAMP)
	$(BIN)/ruff check .

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .ruff_cache
