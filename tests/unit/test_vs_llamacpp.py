"""The pure parts of the llama.cpp side-by-side (benchmarks/vs_llamacpp.py, benchmarks/llamacpp_peer.py):
how each engine is started, the workload, the table and its ratios, a row Pagoda refuses. No binary,
no model and no network: nothing here starts a process."""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks import llamacpp_peer as llama
from benchmarks import vs_llamacpp as vs
from benchmarks.peer_server import REPO
from benchmarks.serve import cpu_features

MODEL = "models/smollm2-135m-instruct"


def test_llama_server_argv_is_the_issue_s_command_line():
    argv = llama.server_argv("models/gguf/m-Q8_0.gguf", 8081, alias="m")
    assert argv == [str(llama.SERVER_BIN), "-m", "models/gguf/m-Q8_0.gguf", "-t", "2", "--parallel", "16",
                    "--ctx-size", "12288", "--host", "127.0.0.1", "--port", "8081", "--alias", "m", "--no-webui"]


def test_each_row_serves_the_same_weights_on_both_sides():
    ports = {"http": 1, "grpc": 2, "scheduler": 3, "worker": 4}
    fp32, q4 = vs.ROWS["fp32"], vs.ROWS["q4_k_m"]
    assert vs.llamacpp_argv(fp32, MODEL, 1)[2] == str(REPO / "models/gguf/smollm2-135m-instruct-F32.gguf")
    assert vs.pagoda_model(fp32, MODEL) == MODEL  # Pagoda's fp32 row: the HF directory the F32 file came from
    pagoda = vs.pagoda_argv(vs.pagoda_model(q4, MODEL), q4.pagoda_dtype, ports)
    assert pagoda[pagoda.index("--model") + 1] == "models/gguf/smollm2-135m-instruct-Q4_K_M.gguf"
    assert pagoda[1:3] == ["-m", "pagoda.entrypoints.launcher"]
    assert pagoda[-2:] == ["--dtype", "auto"]
    assert pagoda[pagoda.index("--gateway-port") + 1] == "1"
    assert vs.llamacpp_argv(q4, MODEL, 1)[2] == str(REPO / pagoda[pagoda.index("--model") + 1])


def test_gguf_kinds_come_from_the_converter_or_from_llama_quantize():
    assert set(llama.KINDS) == {"F32", "BF16", "Q8_0", "Q4_K_M"}
    assert llama.CONVERTED["Q8_0"] == "q8_0" and llama.QUANTIZED == {"Q4_K_M": "F32"}
    assert llama.gguf_path(MODEL, "Q4_K_M") == REPO / "models/gguf/smollm2-135m-instruct-Q4_K_M.gguf"
    with pytest.raises(ValueError, match="unknown GGUF kind"):
        llama.ensure_gguf(MODEL, "IQ2_XS")


def test_converter_sees_the_vendored_gguf_py_first(monkeypatch):
    monkeypatch.setenv("PYTHONPATH", "/elsewhere")
    assert llama.converter_env()["PYTHONPATH"].split(":") == [str(llama.SOURCES / "gguf-py"), str(llama.PYDEPS),
                                                              "/elsewhere"]


def test_modes_the_default_and_one_request_at_a_time():
    many = vs.parse_args([])
    assert (many.concurrency, many.num_prompts, many.out) == (16, 48, Path("benchmarks/results/vs_llamacpp.json"))
    single = vs.parse_args(["--single", "--rows", "q8_0"])
    assert (single.concurrency, single.num_prompts) == (1, 8)
    assert single.out == Path("benchmarks/results/vs_llamacpp_single.json")
    assert vs.workload(single) == {"dataset": "random", "input_len": 256, "output_len": 128, "range_ratio": 0.5,
                                   "num_prompts": 8, "concurrency": 1, "seed": 0}
    with pytest.raises(SystemExit):
        vs.parse_args(["--rows", "q5_k_s"])


WORKER_LOG = """[worker] loading models/gguf/smollm2-135m-instruct-Q4_K_M.gguf
Traceback (most recent call last):
  File "worker_svc/model_loader/gguf_loader.py", line 241, in _check_supported
worker_svc.model_loader.errors.UnsupportedTensorTypeError: unsupported GGUF tensor type: Q4_K, Q6_K; supported: F32, Q8_0
[launcher] worker exited with 1
"""


def test_the_refusal_reason_is_the_loader_s_own_words():
    assert vs.refusal_reason(WORKER_LOG) == "unsupported GGUF tensor type: Q4_K, Q6_K; supported: F32, Q8_0"
    assert vs.refusal_reason("[launcher] worker exited with -9\n") is None  # a crash is a failure, not a refusal


def _run(engine, row, tok_s, tpot, ttft, ready, **extra):
    return {"engine": engine, "row": row, "ready_s": ready, **extra,
            "bench": {"output_throughput": tok_s, "median_tpot_ms": tpot, "median_ttft_ms": ttft}}


def test_ratios_are_pagoda_over_llamacpp_and_better_follows_each_metric_s_direction():
    lines = vs.compare([_run("llamacpp", "q8_0", 100.0, 10.0, 40.0, 1.0), _run("pagoda", "q8_0", 125.0, 12.5, 20.0, 8.0)])
    by_metric = {line["metric"]: line for line in lines}
    assert by_metric["output tok/s"]["pagoda_over_llamacpp"] == 1.25
    assert by_metric["output tok/s"]["better"] == "Pagoda"
    assert by_metric["TPOT p50 ms"]["pagoda_over_llamacpp"] == 1.25
    assert by_metric["TPOT p50 ms"]["better"] == "llama.cpp"
    assert by_metric["TTFT p50 ms"]["better"] == "Pagoda"
    assert by_metric["start to ready s"]["pagoda_over_llamacpp"] == 8.0
    table = vs.format_table(lines, "48 requests, 16 in flight").splitlines()
    assert table[2].split() == ["q8_0", "output", "tok/s", "125.0", "100.0", "1.25x", "Pagoda"]
    assert table[3].split() == ["TPOT", "p50", "ms", "12.5", "10.0", "1.25x", "llama.cpp"]


def test_a_refused_row_shows_llamacpp_alone_and_the_reason():
    refused = {"engine": "pagoda", "row": "q4_k_m", "refused": "unsupported GGUF tensor type: Q4_K"}
    failed = {"engine": "llamacpp", "row": "bf16", "error": "TimeoutError: not ready"}
    lines = vs.compare([_run("llamacpp", "q4_k_m", 150.0, 8.0, 30.0, 0.5), refused,
                        failed, _run("pagoda", "bf16", 90.0, 20.0, 60.0, 9.0)])
    assert [line["row"] for line in lines] == ["q4_k_m"] * 4 + ["bf16"] * 4
    assert all(line["pagoda_over_llamacpp"] is None and line["better"] is None for line in lines)
    table = vs.format_table(lines, "t").splitlines()
    assert table[2].split() == ["q4_k_m", "output", "tok/s", "refused", "150.0", "n/a"]
    assert table[6].strip() == "Pagoda refused: unsupported GGUF tensor type: Q4_K"
    assert table[7].split() == ["bf16", "output", "tok/s", "90.0", "failed", "n/a"]


def test_bench_summary_drops_the_per_request_lists():
    bench = {"output_throughput": 1.5, "completed": 8, "ttfts": [0.1, 0.2], "generated_texts": ["a"], "x": {}}
    assert vs.bench_summary(bench) == {"output_throughput": 1.5, "completed": 8}


def test_cpu_features_keeps_the_model_and_the_simd_flags():
    cpuinfo = ("processor\t: 0\nmodel name\t: AMD EPYC 9R14\nflags\t\t: fpu sse4_2 avx2 fma avx512f avx512_bf16 "
               "avx_vnni ht\n\nprocessor\t: 1\nmodel name\t: AMD EPYC 9R14\nflags\t\t: fpu\n")
    assert cpu_features(cpuinfo) == {"model": "AMD EPYC 9R14",
                                     "flags": ["avx2", "avx512_bf16", "avx512f", "avx_vnni", "fma", "sse4_2"]}


def test_the_build_names_each_vector_extension_the_cpu_has_and_never_amx():
    zen4 = ["sse4_2", "avx", "avx2", "bmi2", "fma", "f16c", "avx512f", "avx512cd", "avx512vl", "avx512dq",
            "avx512bw", "avx512vbmi", "avx512_vnni", "avx512_bf16"]  # no avx_vnni, no AMX
    flags = llama.cmake_flags(zen4, machine="x86_64")
    assert flags[:3] == ["-DLLAMA_CURL=OFF", "-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=OFF"]
    assert "-DGGML_AVX512=ON" in flags and "-DGGML_AVX512_BF16=ON" in flags and "-DGGML_AVX_VNNI=OFF" in flags
    assert flags[-3:] == ["-DGGML_AMX_TILE=OFF", "-DGGML_AMX_INT8=OFF", "-DGGML_AMX_BF16=OFF"]
    avx2_only = llama.cmake_flags(["avx", "avx2", "fma", "f16c", "avx512f"], machine="x86_64")
    assert "-DGGML_AVX512=OFF" in avx2_only  # avx512f alone is not ggml's AVX512 (it wants F, CD, VL, DQ, BW)
    assert llama.cmake_flags([], machine="aarch64")[-1] == "-DGGML_NATIVE=ON"


def test_startup_facts_keep_threads_and_slots_without_timestamps():
    log = ("0.00.897.103 I cmn          init: llama threadpool init, n_threads = 2\n"
           "0.14.948.537 I srv    load_model: initializing, n_slots = 16, n_ctx_slot = 768, kv_unified = 'false'\n"
           "0.15.407.148 I slot get_availabl: id 15 | task -1 | selected slot by LRU, t_last = -1\n")
    assert llama.startup_facts(log) == ["cmn init: llama threadpool init, n_threads = 2",
                                        "srv load_model: initializing, n_slots = 16, n_ctx_slot = 768, "
                                        "kv_unified = 'false'"]


def test_the_bench_client_reads_the_usage_llama_server_sends_beside_its_last_choice():
    from benchmarks.vllm_peer import USAGE_FIX

    scope: dict = {}
    exec(USAGE_FIX, scope)  # the part of the client shim that runs before vLLM's client is imported
    loads = scope["loads_usage_too"]
    last = ('{"choices":[{"text":"","index":0,"logprobs":null,"finish_reason":"length"}],"object":"text_completion",'
            '"usage":{"completion_tokens":21,"prompt_tokens":173}}')
    assert loads(last) == {"object": "text_completion", "usage": {"completion_tokens": 21, "prompt_tokens": 173}}
    token = '{"choices":[{"text":" Paris","index":0}],"object":"text_completion"}'
    assert loads(token)["choices"][0]["text"] == " Paris"
    chat = '{"choices":[{"delta":{"content":"x"}}],"object":"chat.completion.chunk","usage":{"completion_tokens":1}}'
    assert "choices" in loads(chat)  # chat chunks are not touched
