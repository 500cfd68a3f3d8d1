# SpecPilot: two commands on a fresh machine.
#   make run    engine host (default model) + control daemon + dashboard
#   make test   the test suite
VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: run test setup setup-test engine bench clean

run: setup
	$(PY) -m control up

test: setup-test
	$(PY) -m pytest $(PYTEST_ARGS)

setup:
	scripts/setup.sh

setup-test:
	scripts/setup.sh --test

engine: setup
	$(PY) -m engine_host --enforce-eager

clean:
	rm -rf $(VENV) .pytest_cache
