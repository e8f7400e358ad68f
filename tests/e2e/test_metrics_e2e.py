"""The gateway's `/metrics` over real processes: the engine's vLLM series (read from the
scheduler's GetStats at scrape time) and the gateway's latency histograms, after a few requests.

The engine is the session-wide one other e2e tests also use, so engine counters are checked as
differences across this test; the gateway is this module's own, so its histograms start at zero.
"""

from __future__ import annotations

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.e2e.conftest import ENGINE_WORKER_FLAGS

pytestmark = pytest.mark.slow
NUM_REQUESTS = 3
MAX_TOKENS = 5
# Longer than two 16-token blocks: the 2nd and 3rd requests hit the 1st one's cached prefix.
PROMPT = "The river flows past the old mill, under the stone bridge and on towards the distant sea " * 2

ENGINE_COUNTERS = ("vllm:prompt_tokens_total", "vllm:generation_tokens_total",
                   "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total",
                   "vllm:num_preemptions_total", "pagoda:blocks_allocated_total",
                   "pagoda:blocks_freed_total")
GAUGES = ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
          "pagoda:num_free_blocks", "pagoda:num_evictable_blocks", "pagoda:num_total_blocks",
          "pagoda:worker_connected", "pagoda:engine_up")
HISTOGRAMS = ("vllm:time_to_first_token_seconds", "vllm:inter_token_latency_seconds",
              "vllm:e2e_request_latency_seconds", "vllm:request_queue_time_seconds")


def scrape(http_url: str) -> dict[tuple[str, tuple], float]:
    """{(sample name, sorted labels): value} of every pagoda:/vllm: sample."""
    reply = httpx.get(f"{http_url}/metrics", timeout=10)
    assert reply.status_code == 200 and reply.headers["content-type"].startswith("text/plain")
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(reply.text) for s in family.samples
            if s.name.startswith(("vllm:", "pagoda:"))}


def value(samples: dict, name: str, **labels: str) -> float:
    """The one sample `name` whose labels include `labels` (0 when the series has none yet)."""
    found = [v for (n, ls), v in samples.items() if n == name and set(labels.items()) <= set(ls)]
    assert len(found) <= 1, f"{name}{labels} matches {len(found)} samples"
    return found[0] if found else 0.0


def test_metrics_after_a_few_requests(gateway_stack):
    model = gateway_stack.model_dir  # the served name: the model path the scheduler reports
    before = scrape(gateway_stack.http_url)
    usages = []
    for _ in range(NUM_REQUESTS):  # one after the other: the later ones hit the prefix cache
        reply = httpx.post(f"{gateway_stack.http_url}/v1/completions", timeout=30, json={
            "model": model, "prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0,
            "ignore_eos": True})
        assert reply.status_code == 200, reply.text
        usages.append(reply.json()["usage"])
    after = scrape(gateway_stack.http_url)

    # Every engine and latency series carries the served model name. The gateway's own counters are
    # labelled otherwise: HTTP by route, tenancy by tenant, routing by replica.
    gateway_own = ("pagoda:http_requests", "pagoda:tenant_", "pagoda:router_", "pagoda:replica_")
    for (name, labels), _ in after.items():
        if not name.startswith(gateway_own):
            assert dict(labels).get("model_name") == model, (name, labels)
            assert {k for k, _ in labels} <= {"model_name", "finished_reason", "le", "position"}, name
    for name in (*ENGINE_COUNTERS, *GAUGES, "vllm:request_success_total",
                 "pagoda:step_duration_seconds_count", "pagoda:step_duration_seconds_sum",
                 *(f"{h}_count" for h in HISTOGRAMS)):
        assert any(n == name for n, _ in after), f"{name} is not exposed"

    def delta(name: str, **labels: str) -> float:
        return value(after, name, **labels) - value(before, name, **labels)

    # Engine counters (GetStats at scrape time): exact where the workload fixes them.
    num_prompt_tokens = sum(u["prompt_tokens"] for u in usages)
    assert delta("vllm:prompt_tokens_total") == num_prompt_tokens
    assert delta("vllm:generation_tokens_total") == NUM_REQUESTS * MAX_TOKENS
    assert delta("vllm:request_success_total", finished_reason="length") == NUM_REQUESTS
    assert delta("vllm:prefix_cache_queries_total") == num_prompt_tokens
    assert 0 < delta("vllm:prefix_cache_hits_total") < num_prompt_tokens
    assert delta("vllm:num_preemptions_total") == 0
    assert delta("pagoda:blocks_allocated_total") > 0 and delta("pagoda:blocks_freed_total") > 0
    assert delta("pagoda:step_duration_seconds_count") >= MAX_TOKENS
    assert delta("pagoda:step_duration_seconds_sum") > 0

    # Engine gauges: idle again, the pool accounted for.
    assert value(after, "pagoda:engine_up") == 1 and value(after, "pagoda:worker_connected") == 1
    assert value(after, "vllm:num_requests_running") == value(after, "vllm:num_requests_waiting") == 0
    assert 0 <= value(after, "vllm:kv_cache_usage_perc") <= 1
    total = value(after, "pagoda:num_total_blocks")
    assert total == ENGINE_WORKER_FLAGS["num_gpu_blocks_override"]
    assert value(after, "pagoda:num_free_blocks") + value(after, "pagoda:num_evictable_blocks") == total

    # The gateway's histograms (the session's gateway: exactly these requests between the scrapes).
    for name in ("vllm:time_to_first_token_seconds", "vllm:e2e_request_latency_seconds",
                 "vllm:request_queue_time_seconds"):
        assert delta(f"{name}_count") == NUM_REQUESTS, name
        assert delta(f"{name}_bucket", le="+Inf") == NUM_REQUESTS, name
    # Every token after the first has one inter-token latency.
    assert delta("vllm:inter_token_latency_seconds_count") == NUM_REQUESTS * (MAX_TOKENS - 1)
    assert delta("vllm:time_to_first_token_seconds_sum") > 0
    assert delta("vllm:e2e_request_latency_seconds_sum") >= delta("vllm:time_to_first_token_seconds_sum")
    assert delta("pagoda:http_requests_total", route="/v1/completions", status="200") == NUM_REQUESTS
