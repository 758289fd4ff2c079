# jbench: the commands README.md promises. Everything goes into .venv; builds and models into
# $JBENCH_CACHE_DIR (default ~/.cache/jbench); results into ./results.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: install setup demo test test-fast bench ui clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --disable-pip-version-check --upgrade pip
	$(BIN)/python -m pip install -q --disable-pip-version-check -e '.[test]'
	touch $(STAMP)

install: $(STAMP)

# Build llama.cpp (CPU; CUDA when nvcc and a GPU are found), fetch and quantize the bundled model.
setup: $(STAMP)
	$(BIN)/jbench setup

# The main job on the embedded default: the quantization ladder on this machine, into MLflow.
demo: setup
	$(BIN)/jbench calibrate local
	$(BIN)/jbench sweep +experiment=quant_ladder
	@echo
	@echo "Compare the runs in the MLflow UI:  $(BIN)/jbench ui   then open the link it prints (the runs view)"

# Every test, each under pytest-timeout's limit (`timeout` in pyproject.toml).
test: setup
	$(BIN)/python -m pytest -q

# The fast tier: no llama.cpp, sshd, labgrid coordinator, jbench subprocess, MLflow server or Chromium, nothing over ~3 s; under
# 60 s. JBENCH_TEST_TIER=fast makes a test that starts one of those without its marker fail (tests/conftest.py).
test-fast: $(STAMP)
	JBENCH_TEST_TIER=fast $(BIN)/python -m pytest -q -m "not e2e and not ssh and not slow and not coordinator"

bench: setup
	$(BIN)/python bench/overhead.py

ui: $(STAMP)
	$(BIN)/jbench ui

clean:
	rm -rf $(VENV) build dist *.egg-info
