"""The whole engine on CUDA (tiny model): greedy `LLM.generate` on the GPU (CuPy paged attention,
the CUDA cache writes, the device sampler) against HF transformers' `generate` on the same GPU,
token for token in fp32 (the torch attention: the CuPy kernels are fp16/bf16); bf16 (the CuPy
kernels) teacher-forced through HF bf16; the prefix cache's host tier moves
blocks device <-> host exactly (the CPU test's figures, on CUDA)."""

from __future__ import annotations

import random

import pytest
import torch

from pagoda import LLM, SamplingParams
from pagoda.tools.tiny_model import write_model
from tests.worker.test_host_tier_worker import run_sessions


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    out = tmp_path_factory.mktemp("models") / "pagoda-tiny"
    write_model(out)
    return str(out)


def workload(seed: int = 7, count: int = 12) -> tuple[list[list[int]], list[int]]:
    rng = random.Random(seed)
    prompts = [[rng.randrange(10, 2048) for _ in range(rng.randint(3, 150))] for _ in range(count)]
    return prompts, [rng.randint(8, 24) for _ in prompts]


def hf_greedy(model_dir: str, dtype: torch.dtype, prompts: list[list[int]], max_tokens: list[int]) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to("cuda").eval()
    outs = []
    with torch.inference_mode():
        for prompt, n in zip(prompts, max_tokens, strict=True):
            ids = torch.tensor([prompt], device="cuda")
            out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                              do_sample=False, temperature=None, top_p=None, top_k=None, pad_token_id=0)
            outs.append(out[0, len(prompt):].tolist())
    return outs


def pagoda_greedy(model_dir: str, dtype: str, prompts: list[list[int]], max_tokens: list[int], **kwargs) -> list[list[int]]:
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in max_tokens]
    with LLM(model=model_dir, dtype=dtype, device="cuda", block_size=16, **kwargs) as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def test_fp32_greedy_equals_hf_on_cuda(tiny_model_dir: str) -> None:
    prompts, max_tokens = workload()
    reference = hf_greedy(tiny_model_dir, torch.float32, prompts, max_tokens)
    # All at once (one batch, chunked prefill beside decodes) and again with a shared prefix hit.
    assert pagoda_greedy(tiny_model_dir, "float32", prompts, max_tokens) == reference
    shared = [prompts[0][:48] + p for p in prompts]
    assert (pagoda_greedy(tiny_model_dir, "float32", shared, max_tokens, max_num_batched_tokens=64)
            == hf_greedy(tiny_model_dir, torch.float32, shared, max_tokens))


def test_bf16_tokens_are_hf_bf16_choices_on_cuda(tiny_model_dir: str) -> None:
    """bf16 sums in another order than HF's kernels, so free-running streams part at near-ties and
    then differ wholesale. Teacher-forced instead: HF bf16 reads each of our streams and ranks the
    token we chose at every position among its own logits there."""
    from transformers import AutoModelForCausalLM

    prompts, max_tokens = workload(seed=8)
    ours = pagoda_greedy(tiny_model_dir, "bfloat16", prompts, max_tokens)
    hf = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.bfloat16).to("cuda").eval()
    ranks = []
    with torch.inference_mode():
        for prompt, generated in zip(prompts, ours, strict=True):
            logits = hf(torch.tensor([prompt + generated], device="cuda")).logits[0].float()
            at = logits[len(prompt) - 1 : len(prompt) - 1 + len(generated)]
            chosen = at.gather(1, torch.tensor(generated, device="cuda")[:, None])
            ranks += (at > chosen).sum(1).tolist()
    top1 = sum(r == 0 for r in ranks) / len(ranks)
    print(f"bf16 teacher-forced: HF's argmax at {top1:.1%} of {len(ranks)} positions, worst rank {max(ranks)}")
    assert top1 >= 0.9 and max(ranks) <= 4


def test_host_tier_on_cuda(tiny_model_dir: str) -> None:
    plain, plain_cached, _ = run_sessions(tiny_model_dir, device="cuda")
    tiered, tiered_cached, stats = run_sessions(tiny_model_dir, device="cuda", kv_offloading_size=4 / 1024)
    assert tiered == plain
    assert stats.blocks_offloaded > 0 and stats.blocks_loaded > 0
    assert plain_cached[4:] == [32, 32, 16, 0, 0, 0, 0, 0]
    assert tiered_cached[4:] == [32] * 4 + [80] * 4
