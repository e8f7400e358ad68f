"""The serving benchmark's math on hand-made timelines, its arrival process, and its parsers."""

from __future__ import annotations

import numpy as np
import pytest

from benchmarks.scrape import MetricsSample, parse_metrics, summarize
from benchmarks.serve_client import _fold_chunk
from benchmarks.serve_metrics import (
    LatencyStats,
    RequestRecord,
    arrival_intervals,
    compute_metrics,
    format_table,
)


def record(sent: float, chunks: list[float], finished: float, output_len: int, prompt_len: int = 10,
           success: bool = True) -> RequestRecord:
    return RequestRecord(prompt_len=prompt_len, expected_output_len=output_len, sent_at=sent,
                         chunk_times=chunks, finished_at=finished, output_len=output_len, success=success)


def test_one_request_ttft_itl_tpot_e2e():
    r = record(0.0, [0.100, 0.150, 0.250], 0.300, output_len=3)
    assert r.ttft == pytest.approx(0.100)
    assert r.itls == pytest.approx([0.050, 0.100])
    assert r.tpot == pytest.approx((0.300 - 0.100) / 2)
    assert r.e2e == pytest.approx(0.300)


def test_single_token_request_has_no_tpot_and_no_itl():
    r = record(1.0, [1.5], 1.5, output_len=1)
    assert r.tpot is None
    assert r.itls == []


def test_percentiles_interpolate_linearly():
    stats = LatencyStats.of([1.0, 2.0, 3.0, 4.0])
    assert (stats.mean_s, stats.median_s) == (2.5, 2.5)
    assert stats.p95_s == pytest.approx(3.85)  # rank 0.95 * 3 = 2.85: between 3 and 4
    assert stats.p99_s == pytest.approx(3.97)
    assert LatencyStats.of([]) == LatencyStats(0.0, 0.0, 0.0, 0.0)


def test_metrics_pool_itls_and_skip_failed_requests():
    records = [record(0.0, [0.1, 0.15, 0.25], 0.3, output_len=3, prompt_len=10),
               record(1.0, [1.2, 1.3], 1.3, output_len=2, prompt_len=20),
               record(0.5, [], 9.0, output_len=0, prompt_len=99, success=False)]
    m = compute_metrics(records, duration_s=2.0)
    assert (m.completed, m.failed) == (2, 1)
    assert (m.total_input_tokens, m.total_output_tokens) == (30, 5)
    assert m.request_throughput == pytest.approx(1.0)
    assert m.output_throughput == pytest.approx(2.5)
    assert m.total_token_throughput == pytest.approx(17.5)
    assert m.ttft.mean_s == pytest.approx(0.15)
    assert m.ttft.median_s == pytest.approx(0.15)
    assert m.itl.mean_s == pytest.approx((0.05 + 0.10 + 0.10) / 3)  # every gap, pooled
    assert m.tpot.mean_s == pytest.approx(0.1)  # (0.2 / 2) and (0.1 / 1)
    assert m.e2el.p99_s == pytest.approx(0.3)
    out = m.to_json()
    assert out["mean_ttft_s"] == pytest.approx(0.15)
    assert out["p99_itl_s"] == pytest.approx(0.1)
    assert out["completed"] == 2 and "ttft" not in out
    table = format_table("t", m)
    assert "Mean TTFT (ms):" in table and "150.00" in table


def test_poisson_arrivals_have_the_rate_and_unit_coefficient_of_variation():
    gaps = np.array(arrival_intervals(20000, request_rate=4.0, burstiness=1.0, seed=7))
    assert gaps.mean() == pytest.approx(0.25, rel=0.03)
    assert gaps.std() / gaps.mean() == pytest.approx(1.0, rel=0.03)  # exponential: CV = 1


def test_burstiness_changes_the_spread_not_the_rate():
    regular = np.array(arrival_intervals(20000, request_rate=4.0, burstiness=4.0, seed=7))
    bursty = np.array(arrival_intervals(20000, request_rate=4.0, burstiness=0.25, seed=7))
    assert regular.mean() == pytest.approx(0.25, rel=0.03)
    assert bursty.mean() == pytest.approx(0.25, rel=0.05)
    assert regular.std() / regular.mean() == pytest.approx(0.5, rel=0.05)  # gamma: CV = 1/sqrt(shape)
    assert bursty.std() / bursty.mean() == pytest.approx(2.0, rel=0.08)


def test_arrivals_are_seeded_and_infinite_rate_sends_at_once():
    assert arrival_intervals(5, 2.0, 1.0, seed=3) == arrival_intervals(5, 2.0, 1.0, seed=3)
    assert arrival_intervals(5, 2.0, 1.0, seed=3) != arrival_intervals(5, 2.0, 1.0, seed=4)
    assert arrival_intervals(3, float("inf"), 1.0, seed=0) == [0.0, 0.0, 0.0]
    with pytest.raises(ValueError):
        arrival_intervals(3, 1.0, 0.0, seed=0)


METRICS_TEXT = """\
# HELP vllm:num_requests_running Requests in the running batch.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{model_name="m",engine="0"} 3.0
vllm:num_requests_running{model_name="m",engine="1"} 2.0
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{model_name="m"} 0.25
# TYPE vllm:num_preemptions counter
vllm:num_preemptions_total{model_name="m"} 7.0
vllm:num_preemptions_created{model_name="m"} 1.7e9
# TYPE other_metric gauge
other_metric 42.0
"""


def test_parse_metrics_sums_label_sets_and_reads_counter_totals():
    assert parse_metrics(METRICS_TEXT) == {"vllm:num_requests_running": 5.0, "vllm:kv_cache_usage_perc": 0.25,
                                           "vllm:num_preemptions": 7.0}


def test_parse_metrics_reads_prometheus_client_exposition():
    from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest

    registry = CollectorRegistry()
    Counter("vllm:num_preemptions", "p", ["model_name"], registry=registry).labels("m").inc(3)
    Gauge("vllm:num_requests_waiting", "w", ["model_name"], registry=registry).labels("m").set(9)
    text = generate_latest(registry).decode()
    assert parse_metrics(text) == {"vllm:num_preemptions": 3.0, "vllm:num_requests_waiting": 9.0}


def test_summary_of_samples():
    samples = [MetricsSample(0.0, 0.1, 0.0, 1.0, 2.0), MetricsSample(0.5, 0.5, 4.0, 3.0, 2.0),
               MetricsSample(1.0, 0.3, 2.0, 2.0, 5.0), MetricsSample(1.5, None, None, None, None)]
    s = summarize(samples)
    assert (s.num_samples, s.kv_usage_max, s.queue_depth_max, s.running_max) == (4, 0.5, 4.0, 3.0)
    assert s.kv_usage_mean == pytest.approx(0.3)
    assert s.queue_depth_mean == pytest.approx(2.0)
    assert s.preemptions == 3.0
    assert summarize([]).kv_usage_max is None


def test_sse_chunks_fold_into_the_record():
    r = RequestRecord(prompt_len=4, expected_output_len=2)
    assert _fold_chunk({"choices": [{"index": 0, "delta": {"role": "assistant"}}]}, 1.0, r)  # role only
    assert _fold_chunk({"choices": [{"index": 0, "text": "a"}]}, 2.0, r)
    assert _fold_chunk({"choices": [{"index": 0, "delta": {"content": "b"}}]}, 3.0, r)
    assert _fold_chunk({"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 2,
                                                 "prompt_tokens_details": {"cached_tokens": 4}}}, 4.0, r)
    assert r.chunk_times == [2.0, 3.0]
    assert (r.prompt_len, r.output_len, r.cached_tokens) == (5, 2, 4)
    assert not _fold_chunk({"error": {"message": "boom", "code": 500}}, 5.0, r)
    assert r.error == "stream error: boom"
