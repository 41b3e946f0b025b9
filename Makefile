# The two set-up commands on a fresh machine: `make serve` and `make test`.
# Both create .venv and install the project into it; nothing else is assumed.

PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
PYTEST_ARGS ?=

.PHONY: serve test lint install goldens clean openblas chromium sshd clients bench soak

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip

$(STAMP): pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install --quiet -e '.[test]'
	touch $(STAMP)

install: $(STAMP)

# Tests run on mlx's bundled BLAS, the one the goldens were recorded with:
# a preloaded OpenBLAS from the caller's environment is cleared on purpose.
# The real-weights parity set (marker `real`) compares the engine with live mlx-lm
# in one process; it runs in a pytest run of its own with OpenBLAS preloaded (the
# bundled BLAS would take many minutes), beside the rest on two workers
# (tests/suite.sh), on the default model and Gemma 3
# 270M (a K-quant SentencePiece GGUF) fetched once into ~/.cache/mlx-nursery
# (skipped when they cannot be fetched). The tool-call families' chat templates come
# once from the llama-cpp-python source package, and the o200k_base vocabulary that
# openai-harmony needs from the bpe-openai wheel (goldens/family_fixtures.py).
test: install openblas chromium sshd clients
	$(BIN)/ruff check .
	$(BIN)/mlx-nursery models --fetch smollm2-135m-instruct gemma-3-270m \
	  || echo "registry models not fetched: their real-weights tests will skip"
	$(BIN)/python goldens/family_fixtures.py --fetch
	tests/suite.sh $(PYTEST_ARGS)

lint: install
	$(BIN)/ruff check .

# The dashboard test drives Debian's headless Chromium (no browser download at test
# time). Installed here when missing and we may (root with apt-get); the test says
# so when it is still missing.
chromium:
	@if ! command -v chromium >/dev/null && command -v apt-get >/dev/null && [ "$$(id -u)" = 0 ]; then \
	  (DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium || \
	   (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium)) \
	  >/dev/null || echo "could not install chromium: the dashboard test will fail"; \
	fi

# The replica-hostfile test starts replicas over ssh against a private sshd of its
# own on loopback (tests/test_replicas.py): OpenSSH's server, installed here when
# missing and we may (root with apt-get); the test says so when it is missing.
sshd:
	@if ! [ -x /usr/sbin/sshd ] && command -v apt-get >/dev/null && [ "$$(id -u)" = 0 ]; then \
	  (DEBIAN_FRONTEND=noninteractive apt-get install -y -qq openssh-server openssh-client || \
	   (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
	    openssh-server openssh-client)) >/dev/null || echo "could not install openssh-server"; \
	fi

# The real clients the suite runs (tests/test_real_clients.py), pinned, installed
# once from npm into ~/.cache/mlx-nursery/clients and kept: a run of `make test`
# with them in place costs nothing here. The Agents SDK is a pip test dependency.
CLAUDE_CODE_VERSION := 2.1.197
CODEX_VERSION := 0.171.0
CLIENTS ?= $(HOME)/.cache/mlx-nursery/clients
CLIENTS_STAMP := $(CLIENTS)/.installed-$(CLAUDE_CODE_VERSION)-$(CODEX_VERSION)
clients: $(CLIENTS_STAMP)
$(CLIENTS_STAMP):
	mkdir -p $(CLIENTS)
	cd $(CLIENTS) && npm install --no-audit --no-fund --loglevel=error \
	  @anthropic-ai/claude-code@$(CLAUDE_CODE_VERSION) @openai/codex@$(CODEX_VERSION)
	touch $@

# On Debian-like Linux, fetch OpenBLAS first when it is missing and we may install
# (root with apt-get): `serve` preloads it, mlx's bundled BLAS being 5-20x slower.
# Elsewhere this step does nothing and `serve` logs how to get it.
openblas:
	@if [ "$$(uname -s)" = Linux ] && ! ls /usr/lib/*/openblas-pthread/libopenblas.so.0 >/dev/null 2>&1 \
	  && command -v apt-get >/dev/null && [ "$$(id -u)" = 0 ]; then \
	  (apt-get install -y -qq libopenblas0-pthread || \
	   (apt-get update -qq && apt-get install -y -qq libopenblas0-pthread)) >/dev/null \
	  || echo "could not install libopenblas0-pthread; serving with mlx's bundled BLAS"; \
	fi

serve: install openblas
	$(BIN)/mlx-nursery serve $(ARGS)

# Engine and server against mlx-lm on the 30M benchmark model (built once into
# ~/.cache/mlx-nursery, keyed by its builder), then on the real default model (SmolLM2-135M-Instruct,
# dequantized to float32), then sharded on 1-3 ranks, then the overload storm; writes
# docs/benchmarks.md, docs/bench/ and the tables of docs/scale-out.md and
# docs/reliability.md, then the speculative-decoding loads, then Claude Code's agent
# loop request by request (needs `make clients`), then images in the batch
# (bench/vision.py). About an hour and a half.
# `make bench PEERS=1` adds vllm-mlx and rapid-mlx (own venvs in ~/.cache/mlx-nursery/peers,
# installed on first use: each pulls torch, about 6.5 GB and 3 minutes).
# The benchmark model's folder is keyed by a hash of what builds it (goldens/keyed.py).
BENCH_MODEL ?= $(shell $(BIN)/python goldens/make_bench_model.py --if-missing)
bench: install openblas clients
	$(BIN)/python -m pip install --quiet -e '.[test,bench]'
	$(BIN)/python bench/benchsuite.py --model $(BENCH_MODEL) $(if $(PEERS),--peers)
	$(BIN)/python bench/benchsuite.py --model $(BENCH_MODEL) --copies
	$(BIN)/python bench/benchsuite.py --real $(if $(PEERS),--peers)
	$(BIN)/python bench/benchsuite.py --scale-out
	$(BIN)/python bench/benchsuite.py --model $(BENCH_MODEL) --overload
	$(BIN)/python bench/benchsuite.py --model $(BENCH_MODEL) --real --restart --repeats 2
	$(BIN)/python bench/benchsuite.py --model $(BENCH_MODEL) --flood --repeats 2
	$(BIN)/python bench/benchsuite.py --model $(BENCH_MODEL) --priority-flood --repeats 2
	$(BIN)/python bench/benchsuite.py --model $(BENCH_MODEL) --speculative
	$(BIN)/python bench/agent_loop.py
	$(BIN)/python bench/models.py
	$(BIN)/python bench/choices.py --model $(BENCH_MODEL)
	$(BIN)/python bench/quantized_kv.py
	$(BIN)/python bench/decode_floor.py
	$(BIN)/python bench/compiled_step.py --openblas --real --model "bench llama 30M=$(BENCH_MODEL)" --extras --section compiled-step
	$(BIN)/python bench/host_step.py --section host-step
	$(BIN)/python bench/replicas.py
	$(BIN)/python bench/vision.py

# Ten minutes of mixed traffic against a server (streams, drops, bad bodies, long
# prompts): RSS and KV slopes, the ledger, 5xx count; figures into docs/reliability.md.
soak: install
	env -u LD_PRELOAD $(BIN)/python tests/reliability/soak.py $(ARGS)

# Rebuild the tiny models and re-record the mlx-lm goldens (mlx-lm only).
goldens: install
	env -u LD_PRELOAD $(BIN)/python goldens/make_models.py
	env -u LD_PRELOAD $(BIN)/python goldens/make_goldens.py

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .ruff_cache
