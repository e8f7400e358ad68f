"""`pagoda_cpu::bi_linear` (kernels/linear/cpu_bi_linear.cpp) and `--batch-invariant`.

A row's bf16 result must be bit-identical whatever other rows share the call (the point of the op),
close to an fp32 matmul of the same bf16 inputs (one bf16 rounding of an fp32 sum), on AMX and on
the portable path; and greedy decoding in bf16 must give the same tokens with speculation on and off.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from torch import nn

from kernels import cpu_extension

pytestmark = pytest.mark.skipif(not cpu_extension.toolchain_available(), reason="no C++ toolchain")

SHAPES = [(576, 1536), (1536, 576), (70, 45), (33, 17), (64, 32)]  # SmolLM2's, then odd and exact tiles


def _linear(k: int, n: int, bias: bool = False) -> nn.Linear:
    torch.manual_seed(k * 1000 + n)
    return nn.Linear(k, n, bias=bias).to(torch.bfloat16)


@pytest.mark.parametrize("k,n", SHAPES)
def test_rows_do_not_depend_on_the_batch(k: int, n: int) -> None:
    from worker_svc.models.batch_invariant_linear import BatchInvariantLinear

    layer = BatchInvariantLinear(_linear(k, n))
    x = torch.randn(53, k).to(torch.bfloat16)
    full = layer(x)
    for m in (1, 2, 15, 16, 17, 33):
        assert torch.equal(layer(x[:m]), full[:m]), m
    assert torch.equal(layer(x[40:41]), full[40:41])  # a row alone equals itself among 52 others
    # One bf16 rounding of an fp32 sum of exact bf16 products: within 2^-8 relative, plus a little
    # for the different order of the fp32 sum.
    ref = x.float() @ layer_weight(k, n).float().T
    assert torch.allclose(full.float(), ref, rtol=2**-7, atol=1e-3)


def layer_weight(k: int, n: int) -> torch.Tensor:
    return _linear(k, n).weight.detach()


def test_bias_and_leading_dims() -> None:
    from worker_svc.models.batch_invariant_linear import BatchInvariantLinear

    linear = _linear(40, 24, bias=True)
    layer = BatchInvariantLinear(linear)
    x = torch.randn(2, 5, 40).to(torch.bfloat16)
    out = layer(x)
    assert out.shape == (2, 5, 24) and out.dtype == torch.bfloat16
    ref = nn.functional.linear(x.float(), linear.weight.float(), linear.bias.float())
    assert torch.allclose(out.float(), ref, rtol=2**-6, atol=1e-2)


def test_the_portable_path_is_invariant_too() -> None:
    # Its own process: the path is chosen once per process, from the environment.
    code = ("import torch\n"
            "from worker_svc.models.batch_invariant_linear import BatchInvariantLinear, uses_amx\n"
            "torch.manual_seed(0)\n"
            "lin = torch.nn.Linear(70, 45, bias=False).to(torch.bfloat16)\n"
            "layer = BatchInvariantLinear(lin)\n"
            "x = torch.randn(20, 70).to(torch.bfloat16)\n"
            "full = layer(x)\n"
            "assert not uses_amx()\n"
            "assert all(torch.equal(layer(x[:m]), full[:m]) for m in (1, 3, 17))\n"
            "ref = x.float() @ lin.weight.float().T\n"
            "assert torch.allclose(full.float(), ref, rtol=2**-7, atol=1e-3)\n"
            "print('ok')\n")
    env = {**os.environ, "PAGODA_BI_LINEAR_PORTABLE": "1"}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr


def test_greedy_bf16_is_the_same_with_and_without_speculation(tiny_model_dir: str) -> None:
    from pagoda.contract.params import SamplingParams
    from pagoda.entrypoints.llm import LLM

    prompts = [{"prompt_token_ids": [5, 6, 7, 8, 9] * 5 + [10 + i, 11, 12] * (1 + i % 3)} for i in range(6)]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    outputs = {}
    for spec in (None, {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1}):
        llm = LLM(tiny_model_dir, dtype="bfloat16", block_size=4, num_gpu_blocks_override=256,
                  max_num_batched_tokens=64, speculative_config=spec, batch_invariant=True)
        outputs[spec is None] = [r.outputs[0].token_ids for r in llm.generate(prompts, params, use_tqdm=False)]
        if spec is not None:
            assert llm.scheduler.spec_num_accepted_tokens > 0
        llm.close()
    assert outputs[True] == outputs[False]


def test_batch_invariant_refuses_fp16(tiny_model_dir: str) -> None:
    from pagoda.entrypoints.llm import LLM

    with pytest.raises(ValueError, match="batch-invariant supports float32 and bfloat16"):
        LLM(tiny_model_dir, dtype="float16", batch_invariant=True)


def _decode_vs_prefill_logprobs(model_dir: str, batch_invariant: bool) -> list[tuple[float, float]]:
    """Greedy decode 16 tokens (each scored in a 1-row step), then score the same tokens as one
    prefill (many rows per step): (decode logprob, prefill logprob) of every generated token."""
    from pagoda.contract.params import SamplingParams
    from pagoda.entrypoints.llm import LLM

    llm = LLM(model_dir, dtype="bfloat16", batch_invariant=batch_invariant, enable_prefix_caching=False)
    prompts = [[5, 6, 7, 8, 9, 10, 11, 12] * 3, [100, 200, 300, 400, 17, 18] * 4]
    decoded = llm.generate([{"prompt_token_ids": p} for p in prompts],
                           SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, logprobs=0),
                           use_tqdm=False)
    pairs = []
    for prompt, result in zip(prompts, decoded, strict=True):
        out = result.outputs[0]
        again = llm.generate([{"prompt_token_ids": prompt + out.token_ids}],
                             SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0), use_tqdm=False)[0]
        scored = again.prompt_logprobs[len(prompt):]
        pairs += [(d.logprob, p.logprob) for d, p in zip(out.logprobs, scored, strict=True)]
    llm.close()
    return pairs


def test_decode_and_prefill_score_a_token_alike(smollm2_dir) -> None:
    """SmolLM2 in bf16: with --batch-invariant a token's logprob is bit-identical whether computed
    in a decode step (1 row) or inside a prefill (up to 40 rows) — the linears and the attention
    kernel both sum each row alike. Without it, oneDNN's per-shape kernels make them differ (this
    is what makes the test able to fail: measured 30 of 32 differing on an AMX Xeon)."""
    pairs = _decode_vs_prefill_logprobs(str(smollm2_dir), batch_invariant=True)
    assert len(pairs) == 32
    assert all(d == p for d, p in pairs), pairs
