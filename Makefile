# Two commands on a fresh machine: `make serve` and `make test` (each sets up what is missing).
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: setup serve test perf perf-configs bench

$(STAMP): requirements.txt
	@dpkg -s libb64-0d >/dev/null 2>&1 || { apt-get update -qq && apt-get install -y -qq libb64-0d; }
	@test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q -r requirements.txt
	@touch $(STAMP)

setup: $(STAMP)

serve: setup
	$(PY) scripts/serve $(SERVE_ARGS)

test: setup
	$(PY) -m pytest -q tests

perf-configs: setup
	$(PY) scripts/make_perf_configs.py

perf: setup
	$(PY) scripts/perf_sweep.py $(PERF_ARGS)

bench: setup
	$(PY) scripts/bench_model.py
	$(PY) scripts/bench_kernels.py all
