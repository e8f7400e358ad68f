"""Pipeline parallelism, offline (gloo, CPU): PP=2 and TP=2 x PP=2 give the single rank's greedy
tokens (and logprobs within 1e-4) on the generated Llama, Qwen3 (q/k norms), Gemma 2 (soft caps,
sliding-window layers) and Mixtral (experts) models, and on SmolLM2 (PP=2 and PP=3; its 9 query
and 3 KV heads take no TP=2); in a roomy and a cramped pool (preemption), with chunked prefill,
prefix hits and parallel sampling, with LoRA adapters. The stages split the layers as the
partition says and each holds only its layers' weights. (n-gram speculation under PP and TP:
tests/worker/test_spec_decode_llm.py; the served path with plans in flight: tests/e2e/test_pp_e2e.py.)"""

from __future__ import annotations

import random

import pytest

from pagoda import LLM, LoRARequest, SamplingParams
from tests.worker.hf_models import VOCAB, build_hf_model
from tests.worker.lora_adapters import make_adapters
from worker_svc.parallel.pipeline import PipelineError, partition_layers

pytestmark = pytest.mark.slow
ENGINE = {"dtype": "float32", "device": "cpu", "block_size": 8}


def prompts(seed: int = 3, vocab: int = VOCAB) -> list[dict]:
    rng = random.Random(seed)
    shared = [rng.randrange(3, vocab) for _ in range(24)]  # three blocks: prefix hits
    return [{"prompt_token_ids": (shared if i % 2 else []) + [rng.randrange(3, vocab)
                                                           for _ in range(rng.randint(4, 40))]}
            for i in range(8)]


def generate(model_dir: str, tp: int, pp: int, num_blocks: int = 64, n: int = 1, **engine):
    params = SamplingParams(temperature=0.0, max_tokens=10, logprobs=2, ignore_eos=True, n=n)
    with LLM(model=model_dir, tensor_parallel_size=tp, pipeline_parallel_size=pp, num_gpu_blocks_override=num_blocks,
             **{**ENGINE, **engine}) as llm:
        outputs = llm.generate(prompts(), params, use_tqdm=False)
        stats = llm.scheduler.stats()
    tokens = [[c.token_ids for c in o.outputs] for o in outputs]
    logprobs = [lp.logprob for o in outputs for c in o.outputs for lp in c.logprobs]
    return tokens, logprobs, stats


def assert_same(base, other) -> None:
    assert other[0] == base[0]
    assert max(abs(a - b) for a, b in zip(base[1], other[1], strict=True)) < 1e-4


def test_the_layers_split_evenly_the_remainder_to_the_last_stages() -> None:
    assert partition_layers(30, 2) == [(0, 15), (15, 30)]
    assert partition_layers(30, 4) == [(0, 7), (7, 14), (14, 22), (22, 30)]
    with pytest.raises(PipelineError, match="between 1 and the model's 4 layers"):
        partition_layers(4, 5)


@pytest.mark.parametrize("kind", ["llama", "qwen3", "gemma2", "mixtral"])
def test_pp2_and_tp2_x_pp2_match_one_rank(kind: str, tmp_path) -> None:
    model_dir = str(build_hf_model(kind, tmp_path / kind))
    base = generate(model_dir, 1, 1)
    assert_same(base, generate(model_dir, 1, 2))
    assert_same(base, generate(model_dir, 2, 2))


# Swap preemption and the prefix cache's host tier: each stage copies its own layers' blocks.
TIERS = {"swap_space": 0.01, "preemption_mode": "swap", "kv_offloading_size": 0.01}


@pytest.mark.parametrize("num_blocks,tiers", [(256, {}), (12, {}), (12, TIERS)],
                         ids=["roomy", "cramped", "cramped-swap-host-tier"])
def test_pp2_with_chunked_prefill_prefix_hits_forks_and_preemption(tiny_model_dir: str, num_blocks: int,
                                                                   tiers: dict) -> None:
    engine = {"max_num_batched_tokens": 32, "long_prefill_token_threshold": 16, "max_num_seqs": 8, **tiers}
    base = generate(tiny_model_dir, 1, 1, num_blocks, n=2, **engine)
    pp = generate(tiny_model_dir, 1, 2, num_blocks, n=2, **engine)
    assert_same(base, pp)
    stats = pp[2]
    assert stats.prefix_hits > 0
    if num_blocks == 12:
        assert stats.num_preemptions > 0
    if tiers:
        assert stats.num_swap_preemptions > 0


def test_pp2_serves_lora_adapters_as_one_rank(tmp_path) -> None:
    base_dir = build_hf_model("llama", tmp_path / "base")
    adapters = make_adapters(base_dir, tmp_path / "adapters")
    requests = [None, *(LoRARequest(name, i + 1, str(path)) for i, (name, path) in enumerate(adapters.items()))]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    batch = prompts(5)
    loras = [requests[i % len(requests)] for i in range(len(batch))]
    outputs = []
    for pp in (1, 2):
        with LLM(model=str(base_dir), pipeline_parallel_size=pp, enable_lora=True, max_loras=4, max_lora_rank=16,
                 num_gpu_blocks_override=64, **ENGINE) as llm:
            outputs.append([o.outputs[0].token_ids for o in llm.generate(batch, params, lora_request=loras,
                                                                          use_tqdm=False)])
    assert outputs[1] == outputs[0]


def test_smollm2_pp2_and_pp3_match_one_rank(smollm2_dir, chats) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=12)
    outputs = []
    for pp in (1, 2, 3):
        with LLM(model=str(smollm2_dir), pipeline_parallel_size=pp, dtype="float32", device="cpu",
                 num_gpu_blocks_override=128) as llm:
            outputs.append([o.outputs[0].token_ids for o in
                            llm.generate([{"prompt_token_ids": c} for c in chats], params, use_tqdm=False)])
            if pp == 3:  # 30 layers: 10 each, and rank 0 holds only its own (and the embedding)
                stage0 = llm.runner.runner.model
                assert [type(layer).__name__ for layer in stage0.model.layers].count("MissingLayer") == 20
                assert stage0.lm_head is None and stage0.model.norm is None
    assert outputs[1] == outputs[0] and outputs[2] == outputs[0]
