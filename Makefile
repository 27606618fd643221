# Quick start on a fresh machine: `make demo` (main demo) and `make test` (the whole test suite).
# Both create .venv if missing and install everything the project needs; re-runs are quick.

PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.infopt-installed

.PHONY: demo test setup lint clean-venv

$(STAMP): pyproject.toml scripts/setup.sh
	PYTHON=$(PYTHON) VENV=$(VENV) bash scripts/setup.sh
	touch $(STAMP)

setup: $(STAMP)

demo: $(STAMP)
	$(PY) -m infopt.demo

test: $(STAMP)
	$(PY) -m pytest -q

lint: $(STAMP)
	$(VENV)/bin/ruff check src tests examples benchmarks

clean-venv:
	rm -rf $(VENV)
