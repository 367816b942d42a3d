# Two commands do all the setup (see README.md):
#   make lab    venv + edurl (editable, with the dev extra) + Jupyter kernel, then JupyterLab on notebooks/
#   make test   venv + edurl, then the unit tests and every notebook under nbval, the book, and the browser tests
# and one more for reading:
#   make book   the course as a book in _build/html (reuses the notebook executions of `make test`)
#
# Without an NVIDIA GPU, the CPU build of torch is installed first, so that pip never pulls the
# multi-GB CUDA wheels. Override TORCH_CPU_SPEC (e.g. with --index-url ...) if your machine needs it.

PYTHON ?= python3
VENV ?= .venv
TORCH_CPU_SPEC ?= torch==2.13.0
PYTEST_WORKERS ?= 2
# torch threads per test process: cores / workers (at least 1). Two notebooks that each took both cores of a
# 2-core machine ran about 15x slower than one alone; edurl.cpu_threads caps every thread count at this.
TEST_THREADS ?= $(shell c=$$(env -u OMP_NUM_THREADS -u OMP_THREAD_LIMIT nproc 2>/dev/null || sysctl -n hw.ncpu 2>/dev/null || echo 1); w=$(PYTEST_WORKERS); case $$w in (''|*[!0-9]*) w=$$c;; esac; \
	t=$$((c / w)); [ $$t -ge 1 ] || t=1; echo $$t)
TEST_ENV = EDURL_MAX_THREADS=$(TEST_THREADS) OMP_NUM_THREADS=$(TEST_THREADS)
BIN := $(VENV)/bin
HAS_NVIDIA_GPU := $(shell nvidia-smi -L >/dev/null 2>&1 && echo yes)

# JupyterLab refuses to start as root without --allow-root; containers and cloud machines often run as root.
LAB_ROOT_FLAG := $(shell [ "$$(id -u 2>/dev/null)" = 0 ] && echo --allow-root)
# Extra `jupyter lab` options, e.g. LAB_ARGS="--no-browser --port=8890" (the browser tests pass a port and a token).
LAB_ARGS ?=

.PHONY: setup lab lint format test unit notebooks solved-notebooks book browser-tests gpu-check clean-venv

setup: $(VENV)/.edurl-installed

$(VENV)/.edurl-installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --upgrade pip
ifeq ($(HAS_NVIDIA_GPU),yes)
	@echo "NVIDIA GPU found: installing torch with CUDA through the normal dependency resolution."
else
	@echo "No NVIDIA GPU found: installing the CPU build of torch first ($(TORCH_CPU_SPEC))."
	$(BIN)/python -m pip install $(TORCH_CPU_SPEC)
endif
	$(BIN)/python -m pip install -e ".[dev,tinker]"
	touch $@

lab: setup
	$(BIN)/python -m ipykernel install --user --name edurl --display-name "Python (edurl)"
	$(BIN)/jupyter lab notebooks/ $(LAB_ROOT_FLAG) $(LAB_ARGS)

# Lint and format checks (ruff, configured in pyproject.toml); `make format` rewrites the files instead.
lint: setup
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

format: setup
	$(BIN)/ruff check --fix .
	$(BIN)/ruff format .

# Lint, then unit tests and notebooks in one pytest run (--dist loadscope keeps each notebook's cells on one
# worker; book/nbcapture.py keeps each notebook's outputs in _build/executed), then the book from those outputs,
# then the browser tests on the book and JupyterLab.
test: setup lint
	$(TEST_ENV) $(BIN)/python -m pytest -n $(PYTEST_WORKERS) --dist loadscope -m "not browser" tests notebooks --nbval-lax --nbval-current-env
	$(BIN)/python book/build.py --no-execute
	$(MAKE) --no-print-directory browser-tests VENV=$(VENV)

unit: setup
	$(TEST_ENV) $(BIN)/python -m pytest -n $(PYTEST_WORKERS) -m "not browser" tests

notebooks: setup
	$(TEST_ENV) $(BIN)/python -m pytest -n $(PYTEST_WORKERS) --dist loadscope notebooks --nbval-lax --nbval-current-env

# The notebooks as a learner who solved every exercise runs them (tests/solved_notebooks.py); not part of `test`.
solved-notebooks: setup
	$(TEST_ENV) $(BIN)/python tests/solved_notebooks.py --workers $(PYTEST_WORKERS)

# The book (Sphinx + MyST-NB, offline): notebooks without a fresh executed copy in _build/executed run first,
# under the same nbval command; then Sphinx with -W. Open _build/html/index.html.
book: setup
	$(TEST_ENV) $(BIN)/python book/build.py --workers $(PYTEST_WORKERS)

# The browser tests need a Chromium. Where none is found and apt-get works as root, Debian's chromium is
# installed; otherwise the tests skip and say why (under CI=true a skip is a failure).
browser-tests: setup
	@if [ -z "$$EDURL_CHROMIUM" ] && ! command -v chromium >/dev/null 2>&1 && ! command -v chromium-browser >/dev/null 2>&1 \
	    && ! command -v google-chrome >/dev/null 2>&1; then \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	    echo "No Chromium found: installing Debian's chromium for the browser tests (apt-get install chromium)"; \
	    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null; \
	  else \
	    echo "No Chromium found, and apt-get is not usable as root: the browser tests will skip. Install chromium (or set EDURL_CHROMIUM) to run them."; \
	  fi; \
	fi
	$(BIN)/python -m pytest -m browser -rs tests/browser

# On a machine with an NVIDIA GPU: the CUDA tests, every notebook with EDURL_DEVICE=cuda, PPO env-steps/s and
# LLM sampler/GRPO-step timings, in one table (gpu_check.json). Without a GPU it says so and exits 0.
gpu-check: setup
	$(BIN)/python benchmarks/gpu_check.py

clean-venv:
	rm -rf $(VENV)
