# rlfabric: the two commands people need are `make run` and `make test`.
SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
# Marker file: the venv is (re)built when pyproject.toml changes.
STAMP := $(VENV)/.installed
PROTO_FILES := $(wildcard protos/rlfabric/v1/*.proto)

.PHONY: run test setup protos docs lint bench clean

$(STAMP): pyproject.toml
	@test -x $(PY) || python3 -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	# torch first, pinned to the CPU build this machine kind serves (a plain `torch` pulls CUDA wheels).
	$(PIP) install -q "torch==2.13.0"
	$(PIP) install -q -e ".[dev]"
	@touch $(STAMP)

setup: $(STAMP)

## Quickstart: bring up the local mesh and train the tiny model on the synthetic task.
run: setup
	$(VENV)/bin/rlfabric train

## The full test suite (CPU).
test: setup
	$(PY) -m pytest -q

## Regenerate the committed Python stubs from protos/.
protos: setup
	$(PY) -m rlfabric.core.protogen services/v1

## Regenerate docs/config-reference.md from the config classes.
docs: setup
	$(VENV)/bin/rlfabric config-reference > docs/config-reference.md

lint: setup
	$(VENV)/bin/ruff check services tests bench
	cd protos && ../$(VENV)/bin/buf lint

bench: setup
	$(PY) -m bench.run_all

clean:
	rm -rf $(VENV) runs .pytest_cache
