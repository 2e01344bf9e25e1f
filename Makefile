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

install: $(BIN)/kvshard

serve: install
	$(BIN)/kvshard serve --tensor-parallel-size 2 --decode-context-parallel-size 2 $(ARGS)

test: install
	$(BIN)/python -m pytest -q $(ARGS)
