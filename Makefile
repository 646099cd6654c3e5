# The two commands of the README's quick start, and the long sweeps behind a marker.
VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: install train test test-long lint

install:
	bash tools/install.sh

train: install
	$(VENV)/bin/hpc-tba train

test: install
	bash tools/ci_services.sh
	$(PY) -m pytest -q

test-long: install
	$(PY) -m pytest -q -m long

lint: install
	$(PY) -m ruff check hpc_tba tests tools
