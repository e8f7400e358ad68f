"""Multi-LoRA acceptance, offline: in ONE mixed batch of base-model requests and four PEFT adapters
(ranks 8 and 16, different targets, random A and B), every request's greedy output equals HF + PEFT
with its adapter (fp32, token-identical) on the Llama and Qwen2 test models; the prefix cache never
serves one adapter's K/V to another; tensor parallelism changes nothing."""

from __future__ import annotations

import random

import pytest

from pagoda import LLM, LoRARequest, SamplingParams
from pagoda.contract.errors import InvalidRequestError
from tests.worker.hf_models import build_hf_model
from tests.worker.lora_adapters import AdapterSpec, PeftReference, make_adapter, make_adapters
from worker_svc.model_loader.model_config import ModelConfig

pytest.importorskip("peft")
MAX_TOKENS = 10


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def lora_setup(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(f"lora-{request.param}")
    base = build_hf_model(request.param, root / "base")
    adapters = make_adapters(base, root / "adapters")
    cfg = ModelConfig.from_dir(base)
    rng = random.Random(7)
    # short prompts, a few long ones (several prefill chunks), every adapter several times
    prompts = [[rng.randrange(10, cfg.vocab_size) for _ in range(rng.choice((3, 9, 25, 90)))]
               for _ in range(15)]
    names: list[str | None] = [None, *adapters]
    assigned = [names[i % len(names)] for i in range(len(prompts))]
    reference = PeftReference(base, adapters)
    eos = list(cfg.eos_token_ids)
    expected = [reference.generate(p, MAX_TOKENS, a, eos) for p, a in zip(prompts, assigned, strict=True)]
    base_only = [reference.generate(p, MAX_TOKENS, None, eos) for p in prompts]
    # the test means something only if every adapter changes the output
    assert all(e != b for e, b, a in zip(expected, base_only, assigned, strict=True) if a is not None)
    return {"base": str(base), "adapters": adapters, "prompts": prompts, "assigned": assigned,
            "expected": expected, "root": root}


def lora_requests(setup) -> list[LoRARequest | None]:
    ids = {name: i + 1 for i, name in enumerate(setup["adapters"])}
    return [None if a is None else LoRARequest(a, ids[a], str(setup["adapters"][a])) for a in setup["assigned"]]


def make_llm(setup, **kwargs) -> LLM:
    kwargs = {"max_loras": 4, "max_lora_rank": 16, "max_num_batched_tokens": 128, **kwargs}
    return LLM(model=setup["base"], dtype="float32", device="cpu", enable_lora=True, **kwargs)


def generate(llm, setup, loras=None):
    out = llm.generate([{"prompt_token_ids": p} for p in setup["prompts"]],
                       SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS),
                       lora_request=lora_requests(setup) if loras is None else loras, use_tqdm=False)
    return [o.outputs[0].token_ids for o in out]


def test_one_mixed_batch_of_base_and_four_adapters_matches_hf_peft(lora_setup):
    with make_llm(lora_setup) as llm:
        got = generate(llm, lora_setup)
        assert llm.stats().num_preemptions == 0
    assert got == lora_setup["expected"]


def test_fewer_slots_than_adapters_is_still_exact(lora_setup):
    """max_loras=2 with four adapters: requests wait for a slot, slots are refilled from the host."""
    with make_llm(lora_setup, max_loras=2, max_cpu_loras=2) as llm:
        assert generate(llm, lora_setup) == lora_setup["expected"]


def test_prefix_cache_is_isolated_between_adapters(lora_setup):
    setup = lora_setup
    prompt = {"prompt_token_ids": list(range(10, 60))}  # 3 full blocks of 16
    a, b = (LoRARequest(name, i + 1, str(path)) for i, (name, path) in enumerate(list(setup["adapters"].items())[:2]))
    greedy = SamplingParams(temperature=0.0, max_tokens=2)
    with make_llm(setup) as llm:
        def cached(lora):
            return llm.generate(prompt, greedy, lora_request=lora, use_tqdm=False)[0].num_cached_tokens
        assert cached(a) == 0
        assert cached(b) == 0  # same tokens, other adapter: nothing reused
        assert cached(None) == 0  # nor by the base model
        assert cached(a) == cached(b) == cached(None) == 48  # each reuses its own


def test_refusals_name_the_problem(lora_setup, tmp_path):
    big = make_adapter(lora_setup["base"], tmp_path / "r32", AdapterSpec("r32", 32, ("q_proj",)))
    with make_llm(lora_setup, max_lora_rank=16) as llm:
        with pytest.raises(InvalidRequestError, match="max-lora-rank"):
            llm.generate({"prompt_token_ids": [5, 6]}, lora_request=LoRARequest("r32", 9, str(big)), use_tqdm=False)
        with pytest.raises(InvalidRequestError, match="adapter_config.json"):
            llm.generate({"prompt_token_ids": [5, 6]}, lora_request=LoRARequest("nope", 9, str(tmp_path / "missing")), use_tqdm=False)
    with pytest.raises(ValueError, match="max_cpu_loras"):
        make_llm(lora_setup, max_loras=4, max_cpu_loras=2)
    with LLM(model=lora_setup["base"], dtype="float32", device="cpu") as plain:
        with pytest.raises(InvalidRequestError, match="--enable-lora"):
            plain.generate({"prompt_token_ids": [5, 6]}, lora_request=lora_requests(lora_setup)[1],
                           use_tqdm=False)


def test_tensor_parallel_splits_the_adapters_like_the_base_weights(lora_setup):
    """TP=2 (gloo on CPU): A and B split like the projections they belong to, same outputs."""
    with make_llm(lora_setup, tensor_parallel_size=2) as llm:
        assert generate(llm, lora_setup) == lora_setup["expected"]
