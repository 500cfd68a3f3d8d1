# SpecPilot: two commands on a fresh machine.
#   make run        engine host (default model) + control daemon + dashboard
#   make test       the lint step, then the test suite (LINT_FIRST=0 skips the lint step)
#   make test-fast  the tests that need no engine and no browser
#   make lint       ruff (lint and format check) and mypy, as configured in pyproject.toml
VENV ?= .venv
PY := $(VENV)/bin/python
# 1: `make test` runs `make lint` first, so a finding fails the suite (and CI); 0 skips it.
LINT_FIRST ?= 1

.PHONY: run test test-fast lint setup setup-test engine bench clean

run: setup
	$(PY) -m control up

test: setup-test $(if $(filter 1,$(LINT_FIRST)),lint)
	$(PY) -m pytest $(PYTEST_ARGS)

test-fast: setup-test
	$(PY) -m pytest -m "not engine and not browser" $(PYTEST_ARGS)

lint: setup-test
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .
	$(PY) -m mypy

setup:
	scripts/setup.sh

setup-test:
	scripts/setup.sh --test

engine: setup
	$(PY) -m engine_host --enforce-eager

clean:
	rm -rf $(VENV) .pytest_cache
