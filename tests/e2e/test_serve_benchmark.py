"""`benchmarks.serve` and `benchmarks.prefix_ttft` end to end: against a fake OpenAI-compatible
server (fast, every field checked), then once against the real stack on the tiny model.

The fake (FastAPI + uvicorn in a thread, loopback port) streams one SSE chunk per token, records
every request body, exposes vLLM-named gauges at /metrics, rejects token ids >= FAKE_VOCAB at
/detokenize (so the vocabulary probe is exercised), and "caches" a prompt's first CACHED_PREFIX
tokens per cache_salt: a hit answers its first token sooner and reports cached_tokens.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time

import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse

from benchmarks import prefix_ttft, serve
from benchmarks.datasets import WorkloadSpec, make_workload
from tests.e2e.conftest import free_port

pytestmark = pytest.mark.slow

FAKE_VOCAB = 1000
FAKE_MAX_MODEL_LEN = 1024
CACHED_PREFIX = 64
PREFILL_S, CACHED_PREFILL_S, PER_TOKEN_S = 0.03, 0.002, 0.001  # simulated work, not synchronisation


class FakeServer:
    def __init__(self) -> None:
        self.bodies: list[dict] = []
        self.in_flight = 0
        self.max_in_flight = 0
        self.cached: set[tuple] = set()
        self.url = ""  # set once the server listens
        self.app = self._build()

    def _build(self) -> FastAPI:
        app = FastAPI()

        @app.get("/v1/models")
        async def models() -> dict:
            return {"object": "list", "data": [{"id": "fake-model", "max_model_len": FAKE_MAX_MODEL_LEN}]}

        @app.post("/detokenize")
        async def detokenize(request: Request):
            tokens = (await request.json())["tokens"]
            if any(not 0 <= t < FAKE_VOCAB for t in tokens):
                return JSONResponse({"error": {"message": "bad token"}}, status_code=400)
            return {"prompt": " ".join(map(str, tokens))}

        @app.get("/metrics")
        async def metrics() -> PlainTextResponse:
            return PlainTextResponse(
                "# TYPE vllm:num_requests_running gauge\n"
                f'vllm:num_requests_running{{model_name="fake-model"}} {self.in_flight}\n'
                "# TYPE vllm:num_requests_waiting gauge\n"
                'vllm:num_requests_waiting{model_name="fake-model"} 0\n'
                "# TYPE vllm:kv_cache_usage_perc gauge\n"
                f'vllm:kv_cache_usage_perc{{model_name="fake-model"}} {self.in_flight / 16}\n'
                "# TYPE vllm:num_preemptions counter\n"
                'vllm:num_preemptions_total{model_name="fake-model"} 0\n')

        @app.post("/v1/completions")
        async def completions(request: Request) -> StreamingResponse:
            body = await request.json()
            self.bodies.append(body)
            return StreamingResponse(self._stream(body), media_type="text/event-stream")

        return app

    async def _stream(self, body: dict):
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            key = (body.get("cache_salt"), tuple(body["prompt"][:CACHED_PREFIX]))
            hit = key in self.cached
            self.cached.add(key)
            await asyncio.sleep(CACHED_PREFILL_S if hit else PREFILL_S)
            for i in range(body["max_tokens"]):
                if i:
                    await asyncio.sleep(PER_TOKEN_S)
                last = i == body["max_tokens"] - 1
                chunk = {"choices": [{"index": 0, "text": f" t{i}", "finish_reason": "length" if last else None}]}
                yield f"data: {json.dumps(chunk)}\n\n"
            usage = {"prompt_tokens": len(body["prompt"]), "completion_tokens": body["max_tokens"],
                     "prompt_tokens_details": {"cached_tokens": CACHED_PREFIX if hit else 0}}
            yield f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n"
            yield "data: [DONE]\n\n"
        finally:
            self.in_flight -= 1


@pytest.fixture
def fake_server():
    fake = FakeServer()
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(fake.app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "fake server did not start"
        time.sleep(0.01)  # poll interval, bounded by the deadline
    fake.url = f"http://127.0.0.1:{port}"
    yield fake
    server.should_exit = True
    thread.join(timeout=10)


def measured_bodies(fake: FakeServer) -> list[dict]:
    """The benchmark's requests, without the 2-token warm-up request."""
    assert fake.bodies[0]["max_tokens"] == 2
    return fake.bodies[1:]


def test_single_run_reports_every_field_and_sends_exact_lengths(fake_server, tmp_path):
    out = tmp_path / "result.json"
    result = serve.main(["--base-url", fake_server.url, "--dataset", "random", "--num-prompts", "6",
                         "--random-input-len", "20", "--random-output-len", "5", "--request-rate", "50",
                         "--seed", "1", "--metrics-interval", "0.05", "--no-progress",
                         "--out", str(out), "--plot", str(tmp_path / "plots")])
    workload = make_workload(WorkloadSpec(dataset="random", num_prompts=6, vocab_size=FAKE_VOCAB,
                                          max_model_len=FAKE_MAX_MODEL_LEN, seed=1, input_len=20, output_len=5))
    bodies = measured_bodies(fake_server)
    assert [b["prompt"] for b in bodies] == [w.prompt_token_ids for w in workload]  # vocab probed: 1000
    assert [b["max_tokens"] for b in bodies] == [w.max_tokens for w in workload]
    assert all(b["ignore_eos"] and b["stream"] and b["model"] == "fake-model" for b in bodies)
    assert len({b["cache_salt"] for b in bodies}) == 1  # one salt per run
    assert (result["completed"], result["failed"], result["errors"]) == (6, 0, [])
    assert result["total_output_tokens"] == sum(w.max_tokens for w in workload)
    assert result["total_input_tokens"] == sum(len(w.prompt_token_ids) for w in workload)
    for name in ("ttft", "tpot", "itl", "e2el"):
        for stat in ("mean", "median", "p95", "p99"):
            assert result[f"{stat}_{name}_s"] > 0, f"{stat}_{name}_s"
    assert result["mean_ttft_s"] >= PREFILL_S
    assert result["mean_e2el_s"] > result["mean_ttft_s"]
    assert result["request_throughput"] == pytest.approx(6 / result["duration_s"])
    assert result["server"]["num_samples"] >= 2 and result["server"]["preemptions"] == 0
    assert result["server"]["kv_usage_max"] is not None
    assert json.loads(out.read_text()) == result
    assert (tmp_path / "plots" / "kv_usage_over_time.png").stat().st_size > 0


def test_concurrency_sweep_caps_requests_in_flight(fake_server, tmp_path):
    result = serve.main(["--base-url", fake_server.url, "--dataset", "sharegpt-like", "--num-prompts", "4",
                         "--length-scale", "0.05", "--sweep-concurrency", "1,2", "--no-progress",
                         "--no-warmup", "--plot", str(tmp_path)])
    assert result["sweep"] == "max_concurrency"
    assert [r["max_concurrency"] for r in result["runs"]] == [1, 2]
    assert [r["completed"] for r in result["runs"]] == [4, 4]
    assert fake_server.max_in_flight == 2
    salts = [b["cache_salt"] for b in fake_server.bodies]
    assert len(set(salts[:4])) == 1 and set(salts[:4]).isdisjoint(salts[4:])  # runs never share a cache
    assert (tmp_path / "throughput_vs_concurrency.png").stat().st_size > 0


def test_request_rate_sweep_plots_latency(fake_server, tmp_path):
    result = serve.main(["--base-url", fake_server.url, "--dataset", "prefix-repetition", "--num-prompts", "3",
                         "--prefix-len", "80", "--suffix-len", "4", "--num-prefixes", "1",
                         "--random-output-len", "3", "--sweep-request-rates", "100,inf", "--no-progress",
                         "--plot", str(tmp_path)])
    assert [r["request_rate"] for r in result["runs"]] == [100.0, "inf"]
    assert all(r["completed"] == 3 and r["total_output_tokens"] == 9 for r in result["runs"])
    assert (tmp_path / "latency_vs_request_rate.png").stat().st_size > 0


def test_prefix_ttft_compares_cold_and_warm(fake_server, tmp_path):
    result = prefix_ttft.main(["--base-url", fake_server.url, "--system-prompt-tokens", "128",
                               "--num-requests", "3", "--out", str(tmp_path / "p.json")])
    assert result["cold"]["cached_tokens"] == [0, 0, 0]
    assert result["warm"]["cached_tokens"] == [CACHED_PREFIX] * 3
    assert result["speedup_median"] > 1.0
    lengths = [len(b["prompt"]) for b in fake_server.bodies]
    assert lengths == [16, 128 + 16] + [128 + 16, 128 + 16, 16] * 3  # server warm-up, cache fill, phases
    assert all(b["max_tokens"] == 1 for b in fake_server.bodies)
    assert result["suffix_only"]["cached_tokens"] == [0, 0, 0]
    assert json.loads((tmp_path / "p.json").read_text())["num_requests"] == 3


def test_against_the_real_stack(gateway_stack, tmp_path):
    """Worker + scheduler + gateway on the tiny model: exact token counts, real prefix-cache hits."""
    result = serve.main(["--base-url", gateway_stack.http_url, "--dataset", "random", "--num-prompts", "4",
                         "--random-input-len", "32", "--random-output-len", "4", "--random-range-ratio", "0",
                         "--no-progress", "--out", str(tmp_path / "r.json")])
    assert (result["completed"], result["failed"]) == (4, 0), result["errors"]
    assert (result["total_input_tokens"], result["total_output_tokens"]) == (4 * 32, 4 * 4)
    assert result["p99_ttft_s"] >= result["median_ttft_s"] > 0
    prefix = prefix_ttft.main(["--base-url", gateway_stack.http_url, "--system-prompt-tokens", "256",
                               "--num-requests", "2"])
    assert prefix["cold"]["cached_tokens"] == [0, 0]
    assert prefix["warm"]["cached_tokens"] == [256, 256]
