# rlfabric: the two commands people need are `make run` and `make test`.
SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
# Marker file: the venv is (re)built when pyproject.toml changes.
STAMP := $(VENV)/.installed
PROTO_FILES := $(wildcard protos/rlfabric/v1/*.proto)

.PHONY: run test setup system-deps protos docs lint bench clean

$(STAMP): pyproject.toml
	@test -x $(PY) || python3 -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	# torch first, pinned to the CPU build this machine kind serves (a plain `torch` pulls CUDA wheels).
	$(PIP) install -q "torch==2.13.0"
	$(PIP) install -q -e ".[dev]"
	@touch $(STAMP)

# System packages the tests use: Debian's prometheus (promtool and a real scraper for the metrics tests).
SYSDEPS := prometheus
system-deps:
	@missing=""; for p in $(SYSDEPS); do dpkg -s $$p >/dev/null 2>&1 || missing="$$missing $$p"; done; \
	if [ -n "$$missing" ]; then \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	    echo "installing Debian packages:$$missing"; \
	    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $$missing >/dev/null; \
	  else echo "please install the Debian packages:$$missing (the tests that need them will fail)"; fi; \
	fi

setup: $(STAMP)

## Quickstart: bring up the local mesh and train the tiny model on the synthetic task.
run: setup
	$(VENV)/bin/rlfabric train

## The full test suite (CPU).
test: setup system-deps
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
