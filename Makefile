# jbench: the commands README.md promises. Everything goes into .venv; builds and models into
# $JBENCH_CACHE_DIR (default ~/.cache/jbench); results into ./results.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

# Exact versions of everything installed (constraints.txt, made by `make lock`): two installs a month apart get the
# same. The extras: test (the suite) and farm (labgrid: `jbench farm`, and the farm's tests).
PIP := $(BIN)/python -m pip --disable-pip-version-check
EXTRAS := test,farm

.PHONY: install setup demo test test-fast bench ui clean lock

$(STAMP): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q -c constraints.txt --upgrade pip
	$(PIP) install -q -c constraints.txt -e '.[$(EXTRAS)]'
	touch $(STAMP)

install: $(STAMP)

# Rebuild constraints.txt from pyproject.toml alone: a fresh virtualenv in a temporary directory (nothing of $(VENV)
# or of an older lock leaks in), the newest versions pyproject.toml allows of jbench's dependencies and every extra,
# then each installed distribution's exact version (jbench itself left out). Commit the result.
lock:
	@tmp=$$(mktemp -d) && trap 'rm -rf "$$tmp"' EXIT && \
	$(PYTHON) -m venv "$$tmp/venv" && \
	"$$tmp/venv/bin/python" -m pip install -q --disable-pip-version-check --upgrade pip && \
	"$$tmp/venv/bin/python" -m pip install -q --disable-pip-version-check '.[test,farm,server,bundled-model]' && \
	{ sed -n '/^#/p' constraints.txt 2>/dev/null || true; \
	  "$$tmp/venv/bin/python" -m pip freeze --all --disable-pip-version-check | grep -v -i -E '^jbench([ =@]|$$)'; \
	} > "$$tmp/constraints.txt" && mv "$$tmp/constraints.txt" constraints.txt && \
	echo "constraints.txt: $$(grep -c '==' constraints.txt) pinned distributions"

# Build llama.cpp (CPU; CUDA when nvcc and a GPU are found), fetch and quantize the bundled model.
setup: $(STAMP)
	$(BIN)/jbench setup

# The main job on the embedded default: the quantization ladder on this machine, into MLflow.
demo: setup
	$(BIN)/jbench calibrate local
	$(BIN)/jbench sweep +experiment=quant_ladder
	@echo
	@echo "Compare the runs in the MLflow UI:  $(BIN)/jbench ui   then open the link it prints (the runs view)"

# Every test, each under pytest-timeout's limit (`timeout` in pyproject.toml), in two passes (README.md gives the
# measured times): every test not marked `alone` on $(TEST_WORKERS) pytest-xdist workers (--dist loadfile keeps an
# xdist_group on one worker), then the `alone` tests (a speed difference between real builds, or a load they make)
# serially, with nothing beside them. The SIMD-less llama-bench those need builds (niced, through ccache) in the
# background beside the first pass, which the second waits for (tests/nosimd_build.py; the fixture builds it anyway
# if this did not). The exit status is the first pass's failure, else the second's.
TEST_WORKERS ?= 2
test: setup
	@$(BIN)/python -m tests.nosimd_build & build=$$!; status=0; \
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile -m "not alone" --durations=50 || status=$$?; \
	wait $$build || true; \
	$(BIN)/python -m pytest -q -m "alone" --durations=10 || { rc=$$?; [ $$status -ne 0 ] || status=$$rc; }; \
	exit $$status

# The fast tier: no llama.cpp, sshd, labgrid coordinator, jbench subprocess, MLflow server or Chromium, no test over ~3 s,
# on $(TEST_WORKERS) pytest-xdist workers (README.md gives the tier's measured time). JBENCH_TEST_TIER=fast makes a test
# that starts one of those without its marker fail (tests/conftest.py).
test-fast: $(STAMP)
	JBENCH_TEST_TIER=fast $(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile -m "not e2e and not ssh and not slow and not coordinator"

bench: setup
	$(BIN)/python bench/overhead.py

ui: $(STAMP)
	$(BIN)/jbench ui

clean:
	rm -rf $(VENV) build dist *.egg-info
