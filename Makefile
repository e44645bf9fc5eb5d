# Two commands on a fresh machine: `make serve` and `make test` (each sets up what is missing).
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: setup serve train test perf perf-configs model-repository bench

$(STAMP): requirements.txt pyproject.toml
	@dpkg -s libb64-0d >/dev/null 2>&1 || { apt-get update -qq && apt-get install -y -qq libb64-0d; }
	@command -v cc >/dev/null 2>&1 || { apt-get update -qq && apt-get install -y -qq gcc libc6-dev; }  # builds the python_inprocess backend
	@test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q -r requirements.txt
	$(PY) -m pip install -q --no-deps recbole==1.2.1  # MovieLens-100k's files (train.py --data movielens); never imported: no deps
	$(PY) -m pip install -q --no-build-isolation --no-deps -e .  # kernels, ikbo_backend importable from anywhere
	@touch $(STAMP)

setup: $(STAMP)

serve: setup
	$(PY) scripts/serve $(SERVE_ARGS)

# train the ranker (IKBO variant) on click data with a planted teacher (TRAIN_ARGS="--data movielens": on
# MovieLens-100k); writes the weights `make serve` loads.
# One torch thread by default: on a small shared CPU, intra-op threads waiting for a busy core cost 5x a step.
TRAIN_THREADS ?= 1
train: setup
	$(PY) scripts/train.py --threads $(TRAIN_THREADS) $(TRAIN_ARGS)

test: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(PY) -m pytest -q --durations=25 tests

perf-configs: setup
	$(PY) scripts/make_perf_configs.py

# rewrite model_repository/'s configs from their role templates (ikbo_backend/model_repository.py)
model-repository: setup
	$(PY) scripts/make_model_repository.py

# on a GPU machine: the GPU serving run of docs/results.md (large profile); else the CPU sweep
perf: setup
	@if nvidia-smi -L >/dev/null 2>&1; then PATH="$(CURDIR)/$(VENV)/bin:$$PATH" OUT="$${OUT:-out/gpu}" scripts/gpu_serving_run.sh; \
	else $(PY) scripts/perf_sweep.py $(PERF_ARGS); fi

bench: setup
	$(PY) scripts/bench_model.py
	$(PY) scripts/bench_kernels.py all
