# Two commands do everything on a fresh machine: `make test` and `make demo`.
# Both create the project-local virtualenv .venv on first use (idempotent afterwards).
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.megaprm-installed
NPROC  ?= 2
# pytest-xdist workers for the suite (each test module stays on one worker: its module-scoped
# runs are built once), modules in tests/conftest.py's order (slowest first; xdist would
# otherwise start the modules with the most tests first, leaving a long one-test module last);
# docs/testing-durations.md has the measured wall time
WORKERS ?= 2
PYTEST  = $(PY) -m pytest -q -x -n $(WORKERS) --dist loadfile --no-loadscope-reorder --timeout=900 \
          --durations=25

.PHONY: install test test-fast test-learning demo bench lint clean

install: $(STAMP)

# torch goes in first: the CPU wheel (2.13.0) unless a CUDA torch is already importable,
# so that megatron-core/transformers never pull the multi-GB CUDA build of torch.
# pip runs quiet (-q); each step says what it installs first (the whole install takes minutes)
$(STAMP): setup.py
	@echo "[install 1/4] $(VENV): a virtualenv (once)"
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@echo "[install 2/4] pip upgrade"
	$(PY) -m pip install -q --upgrade pip
	@echo "[install 3/4] torch 2.13.0, the CPU build (skipped where a CUDA torch imports)"
	$(PY) -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() or torch.__version__.startswith('2.13.0') else 1)" 2>/dev/null \
		|| $(PY) -m pip install -q torch==2.13.0
	@echo "[install 4/4] megaprm and its dependencies (megatron-core, transformers, ...; minutes)"
	$(PY) -m pip install -q -e ".[dev]"
	touch $(STAMP)
	@echo "[install] done: $(VENV)"

# `make test KERNEL_PATH=avx2` (or default, avx512) runs under that CPU kernel path of torch,
# as a CPU of that kind computes (docs/testing.md; tests/kernel_paths.py holds the table)
KPATH = e=$$($(PY) -m tests.kernel_paths --env "$(KERNEL_PATH)") && env $$e

test: install
	$(KPATH) $(PYTEST) -m "not second_path" tests

# the same suite without the end-to-end runs marked `slow` (pytest.ini says which)
test-fast: install
	$(KPATH) $(PYTEST) -m "not slow and not second_path" tests

# the tests that assert a training outcome, rerun under a second kernel path of this CPU
# (`make test` ran them under the native one); CI runs both targets. Every path this CPU has:
# `.venv/bin/python -m tests.kernel_paths --run-learning`
test-learning: install
	$(PY) -m pytest -q -p no:cacheprovider --durations=5 -m second_path tests/test_kernel_paths.py

# `make demo DEMO_ARGS="--method prof_grpo"` picks another method, "--from-scratch" retrains the start
demo: install
	$(VENV)/bin/megaprm demo $(DEMO_ARGS)

# well over 10 minutes on a 2-core CPU (progress per benchmark); results in runs/bench/,
# `make bench BENCH_ARGS=--update-results` rewrites the committed scripts/results/
bench: install
	$(PY) -m megaprm.cli bench $(BENCH_ARGS)

lint: install
	$(VENV)/bin/ruff check megaprm checkpoint_tools eval scripts tests

clean:
	rm -rf $(VENV) runs .pytest_cache
