# Quick start on a fresh machine: `make demo` (main demo) and `make test` (the whole test suite).
# Both create .venv if missing and install everything the project needs; re-runs are quick.

PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.infopt-installed

.PHONY: demo test test-fast setup lint clean-venv

$(STAMP): pyproject.toml scripts/setup.sh
	PYTHON=$(PYTHON) VENV=$(VENV) bash scripts/setup.sh
	touch $(STAMP)

setup: $(STAMP)

demo: $(STAMP)
	$(PY) -m infopt.demo

# everything, one worker per logical CPU up to 3 (a worker peaked at 5.8 GiB resident in a 2-worker run), one
# thread each; worksteal: a worker that runs out takes queued tests from another, so the long compiling tests do not
# end the run on one worker
test: $(STAMP)
	OMP_NUM_THREADS=1 $(PY) -m pytest -q -n logical --maxprocesses 3 --dist worksteal -p no:cacheprovider

# the developer's loop: tiny-model and pure-logic tests, no compile-heavy (slow) or real-model tests, on every core
# (one thread per worker: two workers of two threads each would fight over two cores). `make test` runs everything.
test-fast: $(STAMP)
	OMP_NUM_THREADS=1 $(PY) -m pytest -q -n auto -m "not slow and not real_model" -p no:cacheprovider

# ruff, then infopt's floors (.importlinter: imports only point down, no loops; tests/test_layering.py runs them too)
lint: $(STAMP)
	$(VENV)/bin/ruff check src tests examples benchmarks
	$(VENV)/bin/lint-imports --no-cache

clean-venv:
	rm -rf $(VENV)
