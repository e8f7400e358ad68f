# Pagoda: `make run` serves the default model locally; `make test` runs the whole suite.
# Both create .venv, install, generate the protos and the default model first.

PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
MODEL  ?= models/pagoda-tiny
TP     ?= 1
PROTO_SRC := $(wildcard protos/pagoda/v1/*.proto)
PROTO_OUT := pagoda/v1/.generated

.PHONY: setup protos model run test test-fast lint clean

setup: $(VENV)/.installed $(PROTO_OUT)

# The `cuda` extra brings CuPy and NVRTC: CPU machines use them only to compile the kernels
# for sm_90 in the tests, never to run them.
$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[dev,cuda]'
	touch $@

protos: $(PROTO_OUT)

# Generated code lands in pagoda/v1/ (gitignored): `from pagoda.v1 import worker_pb2`.
$(PROTO_OUT): $(PROTO_SRC) $(VENV)/.installed
	mkdir -p pagoda/v1
	$(BIN)/python -m grpc_tools.protoc -I protos --python_out=. --pyi_out=. \
		--grpc_python_out=. $(PROTO_SRC)
	touch pagoda/v1/__init__.py $@

model: setup
	$(BIN)/python -m pagoda.tiny_model --out models/pagoda-tiny

run: model
	$(BIN)/python -m pagoda.launcher --model $(MODEL) --tensor-parallel-size $(TP)

test: model
	$(BIN)/python -m pytest -q -ra

# Unit tests only (no processes, no HF parity): a quick loop while editing.
test-fast: setup
	$(BIN)/python -m pytest -q tests/unit

lint: setup
	$(BIN)/ruff check .

clean:
	rm -rf $(VENV) pagoda/v1 .pytest_cache
