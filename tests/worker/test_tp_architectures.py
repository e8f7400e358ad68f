"""TP=2 over the other model families (gloo, CPU): Qwen2's sharded QKV bias and tied
embedding, Qwen3's q/k norms with head_dim != hidden/heads and 4 query heads per KV head, and a
checkpoint saved in several safetensors shards (Llama), and the MoE families (each rank holds a
slice of every expert's columns; Qwen3-MoE with a dense layer between its sparse ones), and Gemma 2 / 3
(per-head Gemma q/k norms, soft caps). Same greedy
tokens and logprobs (1e-4) as TP=1."""

from __future__ import annotations

import random

import pytest

from pagoda import LLM, SamplingParams
from tests.worker.hf_models import VOCAB, build_hf_model

pytestmark = pytest.mark.slow
ENGINE = {"dtype": "float32", "device": "cpu", "block_size": 8, "num_gpu_blocks_override": 64}


def generate(model_dir: str, tp: int):
    rng = random.Random(3)
    prompts = [{"prompt_token_ids": [rng.randrange(3, VOCAB) for _ in range(rng.randint(4, 40))]}
               for _ in range(6)]
    params = SamplingParams(temperature=0.0, max_tokens=8, logprobs=2, ignore_eos=True)
    with LLM(model=model_dir, tensor_parallel_size=tp, **ENGINE) as llm:
        outputs = llm.generate(prompts, params, use_tqdm=False)
    return ([o.outputs[0].token_ids for o in outputs],
            [lp.logprob for o in outputs for lp in o.outputs[0].logprobs])


@pytest.mark.parametrize("kind", ["qwen2", "qwen3", "llama", "phi3", "olmo2", "granite", "mixtral", "qwen3_moe",
                                  "olmoe", "gemma2", "gemma3"])
def test_tp2_matches_tp1(kind: str, tmp_path) -> None:
    model_dir = str(build_hf_model(kind, tmp_path / kind))
    (tokens1, logprobs1), (tokens2, logprobs2) = generate(model_dir, 1), generate(model_dir, 2)
    assert tokens2 == tokens1
    assert max(abs(a - b) for a, b in zip(logprobs1, logprobs2, strict=True)) < 1e-4
