"""The gateway's /metrics text: engine stats turned into vLLM-named series at scrape time, and the
per-request latency histograms in seconds with vLLM's buckets."""

from __future__ import annotations

import asyncio

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from gateway.metrics import TTFT_BUCKETS, EngineStatsCollector, GatewayMetrics
from pagoda.v1 import engine_pb2

MODEL = "pagoda-tiny"


def fake_stats() -> engine_pb2.EngineStats:
    return engine_pb2.EngineStats(
        num_running=3, num_waiting=2, num_free_blocks=90, num_evictable_blocks=6,
        num_used_blocks=32, num_total_blocks=128, kv_cache_usage=0.25, prefix_cache_queries=400,
        prefix_cache_hits=96, num_preemptions=1, prompt_tokens=1234, generation_tokens=567,
        num_steps=50, step_seconds_sum=1.5, blocks_allocated=70, blocks_freed=38,
        num_step_failures=3, num_requests_isolated=1, spec_num_drafts=5, spec_num_draft_tokens=18,
        spec_num_accepted_tokens=11, spec_accepted_per_pos=[5, 4, 2], num_pinned_blocks=3, request_success={"stop": 4, "length": 2}, worker_connected=True,
        brownout_active=True, brownout_entries=2, brownout_capped_requests=7, num_swapped=2,
        num_swap_preemptions=4, blocks_swapped_out=40, blocks_swapped_in=36, num_cpu_blocks=64,
        cpu_kv_cache_usage=0.0625, prefill_tokens_computed=1500, num_offload_blocks=256,
        offload_kv_cache_usage=0.5, blocks_offloaded=300, blocks_loaded=120, blocks_offload_dropped=172,
        num_disk_blocks=1000, disk_kv_cache_usage=0.25, blocks_disk_written=250, blocks_disk_loaded=90,
        blocks_disk_dropped=5, kv_pulls=3, kv_pull_fallbacks=1, kv_pull_bytes=8_000_000,
        encoder_tokens=576, encoder_cache_hits=9)


def samples(text: bytes) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """{(sample name, sorted labels): value} for every sample in the exposition text."""
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text.decode())
            for s in family.samples}


def scrape_collector(get_stats) -> dict:
    registry = CollectorRegistry()
    registry.register(EngineStatsCollector(get_stats, MODEL))
    return samples(generate_latest(registry))


def test_engine_stats_become_vllm_series_with_model_name() -> None:
    got = scrape_collector(fake_stats)
    model = (("model_name", MODEL),)
    assert got == {
        ("pagoda:engine_up", model): 1.0,
        ("vllm:num_requests_running", model): 3.0,
        ("vllm:num_requests_waiting", model): 2.0,
        ("vllm:kv_cache_usage_perc", model): 0.25,
        ("pagoda:num_free_blocks", model): 90.0,
        ("pagoda:num_evictable_blocks", model): 6.0,
        ("pagoda:num_total_blocks", model): 128.0,
        ("pagoda:worker_connected", model): 1.0,
        ("pagoda:num_pinned_blocks", model): 3.0,
        ("pagoda:brownout_active", model): 1.0,
        ("vllm:num_requests_swapped", model): 2.0,
        ("vllm:cpu_cache_usage_perc", model): 0.0625,
        ("pagoda:num_cpu_blocks", model): 64.0,
        ("pagoda:num_offload_blocks", model): 256.0,
        ("pagoda:offload_cache_usage_perc", model): 0.5,
        ("pagoda:offloaded_blocks_total", model): 300.0,
        ("pagoda:offload_loaded_blocks_total", model): 120.0,
        ("pagoda:offload_dropped_blocks_total", model): 172.0,
        ("pagoda:num_disk_blocks", model): 1000.0,
        ("pagoda:disk_cache_usage_perc", model): 0.25,
        ("pagoda:disk_written_blocks_total", model): 250.0,
        ("pagoda:disk_loaded_blocks_total", model): 90.0,
        ("pagoda:disk_dropped_blocks_total", model): 5.0,
        ("pagoda:swap_preemptions_total", model): 4.0,
        ("pagoda:swapped_out_blocks_total", model): 40.0,
        ("pagoda:swapped_in_blocks_total", model): 36.0,
        ("pagoda:prefill_tokens_computed_total", model): 1500.0,
        ("pagoda:brownout_entries_total", model): 2.0,
        ("pagoda:brownout_capped_requests_total", model): 7.0,
        ("pagoda:kv_pulls_total", model): 3.0,
        ("pagoda:kv_pull_fallbacks_total", model): 1.0,
        ("pagoda:kv_pull_bytes_total", model): 8_000_000.0,
        ("pagoda:encoder_tokens_total", model): 576.0,
        ("pagoda:encoder_cache_hits_total", model): 9.0,
        ("vllm:prefix_cache_queries_total", model): 400.0,
        ("vllm:prefix_cache_hits_total", model): 96.0,
        ("vllm:num_preemptions_total", model): 1.0,
        ("vllm:prompt_tokens_total", model): 1234.0,
        ("vllm:generation_tokens_total", model): 567.0,
        ("pagoda:blocks_allocated_total", model): 70.0,
        ("pagoda:blocks_freed_total", model): 38.0,
        ("pagoda:step_failures_total", model): 3.0,
        ("pagoda:requests_isolated_total", model): 1.0,
        ("vllm:spec_decode_num_drafts_total", model): 5.0,
        ("vllm:spec_decode_num_draft_tokens_total", model): 18.0,
        ("vllm:spec_decode_num_accepted_tokens_total", model): 11.0,
        ("vllm:spec_decode_num_accepted_tokens_per_pos_total", model + (("position", "0"),)): 5.0,
        ("vllm:spec_decode_num_accepted_tokens_per_pos_total", model + (("position", "1"),)): 4.0,
        ("vllm:spec_decode_num_accepted_tokens_per_pos_total", model + (("position", "2"),)): 2.0,
        ("vllm:request_success_total", (("finished_reason", "length"),) + model): 2.0,
        ("vllm:request_success_total", (("finished_reason", "stop"),) + model): 4.0,
        ("pagoda:step_duration_seconds_count", model): 50.0,
        ("pagoda:step_duration_seconds_sum", model): 1.5,
    }


def test_scheduler_down_exposes_only_engine_up_zero() -> None:
    assert scrape_collector(lambda: None) == {("pagoda:engine_up", (("model_name", MODEL),)): 0.0}


def test_stats_are_read_at_each_scrape() -> None:
    stats = fake_stats()
    registry = CollectorRegistry()
    registry.register(EngineStatsCollector(lambda: stats, MODEL))
    stats.num_waiting = 9
    text = generate_latest(registry)
    assert samples(text)[("vllm:num_requests_waiting", (("model_name", MODEL),))] == 9.0


def test_gateway_latency_histograms_in_seconds() -> None:
    metrics = GatewayMetrics()
    metrics.model_name = MODEL  # learnt from GetInfo after start-up
    timer = metrics.request_timer(now=100.0)
    timer.on_tokens(1, now=100.05)   # TTFT 0.05 s
    timer.on_tokens(2, now=100.25)   # two tokens in 0.2 s: two ITLs of 0.1 s
    assert abs(timer.time_to_first_token_s - 0.05) < 1e-9
    assert abs(timer.finish(queue_seconds=0.02, now=102.0) - 2.0) < 1e-9

    async def fetch():
        return fake_stats()

    got = samples(asyncio.run(metrics.scrape(fetch)))
    model = ("model_name", MODEL)
    assert got[("vllm:time_to_first_token_seconds_count", (model,))] == 1.0
    assert got[("vllm:time_to_first_token_seconds_bucket", (("le", "0.04"), model))] == 0.0
    assert got[("vllm:time_to_first_token_seconds_bucket", (("le", "0.06"), model))] == 1.0
    assert got[("vllm:inter_token_latency_seconds_count", (model,))] == 2.0
    assert abs(got[("vllm:inter_token_latency_seconds_sum", (model,))] - 0.2) < 1e-9
    assert got[("vllm:e2e_request_latency_seconds_bucket", (("le", "1.5"), model))] == 0.0
    assert got[("vllm:e2e_request_latency_seconds_bucket", (("le", "2.0"), model))] == 1.0
    assert got[("vllm:request_queue_time_seconds_bucket", (("le", "0.3"), model))] == 1.0
    assert got[("vllm:num_requests_running", (model,))] == 3.0  # the engine's series, same scrape
    ttft_bounds = sorted(float(dict(labels)["le"]) for name, labels in got
                         if name == "vllm:time_to_first_token_seconds_bucket")
    assert ttft_bounds == [*TTFT_BUCKETS, float("inf")]


def test_the_schedulers_per_tenant_figures_are_labelled_by_tenant() -> None:
    stats = engine_pb2.EngineStats(
        tenant_blocks_held={"team-a": 12, "": 3}, tenant_blocks_cap={"team-a": 16, "": 64},
        tenant_prompt_tokens={"team-a": 900, "": 40}, tenant_generation_tokens={"team-a": 300, "": 8},
        tenant_requests_waiting={"team-a": 5, "": 0}, tenant_virtual_tokens={"team-a": 1500.0, "": 56.0})
    got = scrape_collector(lambda: stats)
    a = (("model_name", MODEL), ("tenant", "team-a"))
    anonymous = (("model_name", MODEL), ("tenant", "anonymous"))  # "" upstream
    assert {k: v for k, v in got.items() if k[0].startswith("pagoda:tenant_")} == {
        ("pagoda:tenant_kv_blocks", a): 12.0, ("pagoda:tenant_kv_blocks", anonymous): 3.0,
        ("pagoda:tenant_kv_blocks_cap", a): 16.0, ("pagoda:tenant_kv_blocks_cap", anonymous): 64.0,
        ("pagoda:tenant_requests_waiting", a): 5.0, ("pagoda:tenant_requests_waiting", anonymous): 0.0,
        ("pagoda:tenant_virtual_tokens", a): 1500.0, ("pagoda:tenant_virtual_tokens", anonymous): 56.0,
        ("pagoda:tenant_prompt_tokens_total", a): 900.0, ("pagoda:tenant_prompt_tokens_total", anonymous): 40.0,
        ("pagoda:tenant_generation_tokens_total", a): 300.0,
        ("pagoda:tenant_generation_tokens_total", anonymous): 8.0,
    }
