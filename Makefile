# The README's front door: `make demo` and `make test` each set up a virtual
# environment (once) and then run. CONSTRAINTS pins the versions CI uses;
# on a GPU machine install your CUDA torch first and run with CONSTRAINTS=.
PYTHON ?= python3
VENV ?= .venv
CONSTRAINTS ?= constraints.txt
BIN := $(VENV)/bin
STAMP := $(VENV)/.memlm-installed
PIP_C := $(if $(CONSTRAINTS),-c $(CONSTRAINTS),)

.PHONY: setup demo test test-fast test-tf4 lint clean

setup: $(STAMP)

# A line per stage: the installs take minutes and pip --quiet prints nothing meanwhile.
$(STAMP): pyproject.toml $(CONSTRAINTS)
	@echo "[setup] 1/3 creating the virtual environment $(VENV)"
	$(PYTHON) -m venv $(VENV)
	@echo "[setup] 2/3 installing torch (the largest download; a few minutes)"
	$(BIN)/python -m pip install --quiet $(PIP_C) torch
	@echo "[setup] 3/3 installing memlm and its dependencies"
	$(BIN)/python -m pip install --quiet $(PIP_C) -e '.[dev,lmeval]'
	@touch $(STAMP)
	@echo "[setup] done: activate it with . $(VENV)/bin/activate"

# TEST_WORKERS=N runs the suite on N processes (pytest-xdist), one test file
# per worker at a time: a file's module fixtures are built once, and its
# multi-process tests (2-4 gloo ranks, torchrun) ask the OS for free ports.
# One process by default: on a 2-core machine the suite already keeps both
# cores busy (its ranks and subprocesses), and 2 workers took 27.3 minutes
# against about 28 (tests/README.md); machines with more cores gain.
TEST_WORKERS ?= 0
XDIST := $(if $(filter 0,$(TEST_WORKERS)),,-n $(TEST_WORKERS) --dist loadfile)

demo: $(STAMP)
	$(BIN)/python -m memlm.launch.demo $(ARGS)

test: $(STAMP)
	$(BIN)/python -m pytest $(XDIST) $(ARGS)

test-fast: $(STAMP)
	$(BIN)/python -m pytest -m "not slow" $(XDIST) $(ARGS)

# Exports read by transformers 4.x: a second environment with the newest 4.x
# (the main one has transformers 5) and no memlm, used only by a few tests:
# dense bundles (ids, logits, greedy answers), trust_remote_code exports
# loaded without memlm, and the documented tokenizer and model lines on every
# kind of export (tests/integration/test_hf_bundle.py, tests/integration/test_hf_remote.py,
# tests/integration/test_export_reuse.py; docs/checkpoints.md).
TF4_VENV ?= .venv-tf4
TORCH_PIN := $(shell grep '^torch==' $(CONSTRAINTS) 2>/dev/null)
test-tf4: $(STAMP)
	test -x $(TF4_VENV)/bin/python || $(PYTHON) -m venv $(TF4_VENV)
	$(TF4_VENV)/bin/python -m pip install --quiet "transformers==4.57.*" $(or $(TORCH_PIN),torch) safetensors sentencepiece protobuf numpy
	MEMLM_TF4_PYTHON=$(abspath $(TF4_VENV))/bin/python MEMLM_REMOTE_PYTHON=$(abspath $(TF4_VENV))/bin/python \
	  $(BIN)/python -m pytest -m "slow or not slow" tests/integration/test_hf_bundle.py tests/integration/test_hf_remote.py \
	  tests/integration/test_export_reuse.py -k "transformers4 or fresh_venv" $(ARGS)

lint: $(STAMP)
	$(BIN)/ruff check .

clean:
	rm -rf $(VENV) $(TF4_VENV) build *.egg-info .pytest_cache .ruff_cache
