"""FP8 KV cache (`--kv-cache-dtype fp8|fp8_e4m3|fp8_e5m2`) through the real runner and `LLM`.

The kernels' numerics against a dequantised reference are in tests/unit/test_cpu_attention.py;
here: the capacity it buys, and that the engine serves from it (a mixed batch with chunked prefill,
prefix hits and preemption) with logits close to the full-precision cache's.
"""

from __future__ import annotations

import pytest
import torch

from pagoda.contract.params import SamplingParams
from pagoda.entrypoints.llm import LLM
from worker_svc.__main__ import build_config, parse_args
from worker_svc.config import WorkerConfig
from worker_svc.model_runner import ModelRunner

BUDGET = 1 << 22  # bytes of KV cache


@pytest.fixture(scope="module")
def blocks_by_cache_dtype(tiny_model_dir: str) -> dict[tuple[str, str], int]:
    blocks = {}
    for dtype, cache in [("float32", "auto"), ("float16", "auto"), ("bfloat16", "auto"),
                         ("float32", "fp8"), ("bfloat16", "fp8_e5m2")]:
        runner = ModelRunner(WorkerConfig(model=tiny_model_dir, dtype=dtype, kv_cache_memory_bytes=BUDGET,
                                          kv_cache_dtype=cache))
        info = runner.initialize()
        assert runner.kv_cache.storage.dtype == {"auto": runner.dtype, "fp8": torch.float8_e4m3fn,
                                                 "fp8_e5m2": torch.float8_e5m2}[cache]
        blocks[(dtype, cache)] = info.num_blocks
    return blocks


def test_fp8_doubles_the_blocks_of_fp16_in_the_same_memory(blocks_by_cache_dtype) -> None:
    fp16 = blocks_by_cache_dtype[("float16", "auto")]
    assert blocks_by_cache_dtype[("float32", "fp8")] == 2 * fp16 == 4 * blocks_by_cache_dtype[("float32", "auto")]
    assert blocks_by_cache_dtype[("bfloat16", "fp8_e5m2")] == 2 * blocks_by_cache_dtype[("bfloat16", "auto")]


def test_the_flag_reaches_the_worker_config() -> None:
    assert build_config(parse_args(["--model", "m", "--kv-cache-dtype", "fp8_e5m2"])).kv_cache_dtype == "fp8_e5m2"
    with pytest.raises(SystemExit):
        parse_args(["--model", "m", "--kv-cache-dtype", "int4"])


@pytest.mark.parametrize("cache", ["fp8", "fp8_e5m2"])
def test_llm_serves_from_an_fp8_cache_with_logprobs_close_to_fp32(tiny_model_dir: str, cache: str) -> None:
    prefix = [5, 6, 7, 8, 9] * 5  # shared: prefix hits
    prompts = [{"prompt_token_ids": prefix + [10 + i] * (1 + i)} for i in range(6)]
    prompts.append({"prompt_token_ids": [3] * 40})  # chunked at the threshold below
    results = {}
    for kv in ("auto", cache):
        llm = LLM(tiny_model_dir, dtype="float32", block_size=4, num_gpu_blocks_override=40,
                  max_num_batched_tokens=64, long_prefill_token_threshold=16, kv_cache_dtype=kv)
        params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, logprobs=0)
        results[kv] = llm.generate(prompts, params, use_tqdm=False)
        assert llm.scheduler.stats().num_used_blocks == 0
        llm.close()
    # The first sampled token sees every prompt position through the cache: where both runs chose
    # the same one, its logprob moves by FP8 rounding only.
    same_first = [(full.outputs[0], fp8.outputs[0]) for full, fp8 in zip(results["auto"], results[cache], strict=True)
                  if full.outputs[0].token_ids[0] == fp8.outputs[0].token_ids[0]]
    print({cache: f"{len(same_first)}/{len(prompts)} same first token"})
    assert len(same_first) >= len(prompts) // 2
    for full, fp8 in same_first:
        assert fp8.logprobs[0].logprob == pytest.approx(full.logprobs[0].logprob, abs=0.05)


@pytest.mark.parametrize("cache", ["fp8", "fp8_e5m2"])
def test_a_cupy_worker_takes_an_fp8_cache(tiny_model_dir: str, cache: str) -> None:
    # Construction only (no GPU here): the CUDA kernels have FP8 variants, so nothing refuses.
    runner = ModelRunner(WorkerConfig(model=tiny_model_dir, dtype="bfloat16", kv_cache_dtype=cache,
                                      attention_backend="cupy", kv_cache_memory_bytes=BUDGET))
    assert runner.backend.name == "cupy" and runner.cache_dtype.itemsize == 1


def test_a_cupy_worker_refuses_at_start_what_has_no_kernel(tiny_model_dir: str) -> None:
    with pytest.raises(ValueError, match="cupy backend supports float16/bfloat16, not torch.float32"):
        ModelRunner(WorkerConfig(model=tiny_model_dir, dtype="float32", kv_cache_dtype="fp8",
                                 attention_backend="cupy", kv_cache_memory_bytes=BUDGET))
