"""benchmarks.sessions: the same workload for every run, each engine's command and counters."""

from __future__ import annotations

from benchmarks import sessions
from benchmarks import sessions_engines as engines
from benchmarks.serve_client import Endpoint, RequestSpec, request_body
from benchmarks.serve_metrics import RequestRecord

PORTS = {"http": 1, "grpc": 2, "scheduler": 3, "worker": 4}


def test_every_run_gets_the_same_prompts():
    args = sessions.parse_args(["--sessions", "3", "--turns", "3", "--first-len", "20", "--message-len", "5:7",
                                "--output-len", "4"])
    first, again = sessions.plan_sessions(args), sessions.plan_sessions(args)
    assert first == again
    assert [len(p) for p in first[0]][0] == 20
    for prompts in first:  # each turn's prompt extends the previous one (the history grows)
        for before, after in zip(prompts, prompts[1:], strict=False):
            assert after[:len(before)] == before and 4 + 5 <= len(after) - len(before) <= 4 + 7


def test_vllm_gets_the_same_pool_in_tokens_and_prefix_caching():
    argv = engines.server_argv(engines.RUNS["vllm"], "m", "float32", 10_000, 1_900, 4.0, PORTS, ["--x"])
    assert argv[argv.index("--num-gpu-blocks-override") + 1] == "79"  # ceil(10000 / 128)
    assert argv[argv.index("--max-model-len") + 1] == "1900"
    assert "--enable-prefix-caching" in argv and "--kv-offloading-size" not in argv and "--x" not in argv
    offload = engines.server_argv(engines.RUNS["vllm-offload"], "m", "float32", 10_000, 1_900, 4.0, PORTS, [])
    assert offload[offload.index("--kv-offloading-size") + 1] == "4.0"


def test_pagoda_runs_differ_only_by_the_tier():
    off = engines.server_argv(engines.RUNS["off"], "m", "float32", 10_000, 1_900, 4.0, PORTS, ["--x"])
    tier = engines.server_argv(engines.RUNS["tier"], "m", "float32", 10_000, 1_900, 4.0, PORTS, ["--x"])
    assert off[off.index("--num-gpu-blocks-override") + 1] == "625"
    assert "--enable-request-timings" in off and "--x" in off
    assert tier == [*off, "--kv-offloading-size", "4.0"]
    assert engines.server_argv(engines.RUNS["leases"], "m", "float32", 10_000, 1_900, 4.0, PORTS, ["--x"]) == tier


def test_only_the_leases_run_names_sessions():
    body = request_body(Endpoint("http://h", "m"), RequestSpec([5, 6], 2, session_id="session-3"))
    assert body["session_id"] == "session-3" and body["prompt"] == [5, 6]
    assert "session_id" not in request_body(Endpoint("http://h", "m"), RequestSpec([5, 6], 2))


def test_prefill_computed_per_engine():
    delta = {engines.PREFILL: 900.0, engines.QUERIES: 5000.0, engines.HITS: 3000.0, engines.EXTERNAL_HITS: 500.0}
    assert engines.prefill_computed(engines.RUNS["tier"], delta) == 900
    assert engines.prefill_computed(engines.RUNS["vllm"], delta) == 1500  # queries - hits - connector hits


def test_breakdown_splits_turn_one_from_the_rest():
    def record(queue: float, prompt: float) -> RequestRecord:
        return RequestRecord(1, 1, timings={"queue_ms": queue, "prompt_ms": prompt, "ttft_ms": queue + prompt,
                                            "prompt_n": 10})

    records = [(0, 0, record(100, 50)), (0, 1, record(10, 5)), (1, 1, record(30, 7)), (1, 2, record(20, 6))]
    parts = sessions.breakdown(records)
    assert parts["turn 1"] == {"queue_ms": 100, "prompt_ms": 50, "ttft_ms": 150, "prompt_n": 10}
    assert parts["turns 2+"] == {"queue_ms": 20, "prompt_ms": 6, "ttft_ms": 26, "prompt_n": 10}
    assert sessions.breakdown([(0, 1, RequestRecord(1, 1))]) == {}  # vLLM: no timings


def test_a_failed_run_is_a_line_of_the_table():
    row = {"ttft_p50_ms": 1.0, "ttft_p99_ms": 2.0, "cached_tokens_later_turns": 3, "prefill_tokens_computed": 4,
           "blocks_loaded": 5, "preemptions": 6, "breakdown": {}}
    table = sessions.format_table({"tier": row, "vllm-offload": {"error": "RuntimeError: no", "log": "x.log"}})
    assert "vLLM-CPU offload  failed: RuntimeError: no (see x.log)" in table
    assert table.splitlines()[1].split() == ["host", "tier", "on", "1.0", "2.0", "3", "4", "5", "6"]
