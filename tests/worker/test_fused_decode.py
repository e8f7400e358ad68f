"""The fused decode op (kernels/decode/cpu_decode_stack.cpp) against the module loop it replaces,
on the tiny model: the same decode step run both ways from the same prefilled KV cache, for every
linear kind the CPU worker has (oneDNN-packed fp32 / bf16, int8 / int4 quantized), batch 1 and
batches of mixed context lengths (17 rows: padded to the 18-row bucket for oneDNN); then greedy
tokens of `LLM.generate` with the path on and off."""

from __future__ import annotations

import contextlib

import pytest
import torch

from kernels import get_backend
from kernels.cpu_extension import toolchain_available
from pagoda import LLM, SamplingParams
from worker_svc.model_loader.loader import load_model
from worker_svc.models.common import AttentionMetadata
from worker_svc.models.fused_decode import ENV_SWITCH, Setting, fused_decode_for
from worker_svc.models.packed_linear import PackedLinear, can_pack, pack_linear_weights
from worker_svc.models.quant_linear import _ops
from worker_svc.models.row_buckets import bucket_linear_rows

pytestmark = pytest.mark.skipif(not toolchain_available(), reason="no C++ toolchain for the compiled ops")

BLOCK = 16
CPU = torch.device("cpu")


def build(model_dir: str, dtype: torch.dtype, quantization: str | None):
    """The model as the CPU worker runs it: packed + row-bucketed, or quantized at load."""
    model, cfg = load_model(model_dir, dtype, CPU, quantization=quantization)
    if quantization is None:
        pack_linear_weights(model)
        bucket_linear_rows(model, PackedLinear)
    fused, why = fused_decode_for(model, Setting(CPU, dtype, dtype, "cpu"))
    assert fused is not None, why
    return model, cfg, fused


def meta(lens: list[int], q_lens: list[int], tables: torch.Tensor) -> AttentionMetadata:
    """Sequence i has context lens[i] after this step, of which its last q_lens[i] tokens are new."""
    slots, starts = [], [0]
    for i, (n, q) in enumerate(zip(lens, q_lens, strict=True)):
        slots += [int(tables[i, p // BLOCK]) * BLOCK + p % BLOCK for p in range(n - q, n)]
        starts.append(starts[-1] + q)
    return AttentionMetadata(slot_mapping=torch.tensor(slots), block_tables=tables,
                             seq_lens=torch.tensor(lens, dtype=torch.int32),
                             query_start_loc=torch.tensor(starts, dtype=torch.int32),
                             max_query_len=max(q_lens), max_seq_len=max(lens), backend=get_backend("cpu"))


@torch.inference_mode()
def decode_both_ways(model, cfg, fused, contexts: list[int], new_tokens: list[int] | None = None):
    """Prefill every sequence through the module loop, then one step each way from copies of that
    cache, sequence i bringing new_tokens[i] query rows (default 1: a decode step):
    (fused logits, module-loop logits, fused caches, module-loop caches)."""
    new_tokens = new_tokens or [1] * len(contexts)
    gen = torch.Generator().manual_seed(len(contexts))
    per_seq = (max(contexts) + max(new_tokens) + BLOCK - 1) // BLOCK
    # block ids interleaved between sequences, so that a wrong table reads someone else's K/V
    tables = torch.arange(len(contexts) * per_seq, dtype=torch.int32).view(per_seq, -1).t().contiguous()
    shape = (len(contexts) * per_seq, BLOCK, cfg.num_kv_heads, cfg.head_dim)
    dtype = model.model.norm.weight.dtype
    caches = [(torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype)) for _ in range(cfg.num_layers)]
    prompts = [torch.randint(2, cfg.vocab_size, (n,), generator=gen) for n in contexts]
    ids = torch.cat(prompts)
    positions = torch.cat([torch.arange(n) for n in contexts])
    model(ids, positions, meta(contexts, contexts, tables), caches)  # prefill: max_query_len > 1
    step_ids = torch.randint(2, cfg.vocab_size, (sum(new_tokens),), generator=gen)
    step_pos = torch.cat([torch.arange(n, n + q) for n, q in zip(contexts, new_tokens, strict=True)])
    step = meta([n + q for n, q in zip(contexts, new_tokens, strict=True)], new_tokens, tables)
    outs = []
    for path in (fused, None):
        model.fused_decode = path
        copies = [(k.clone(), v.clone()) for k, v in caches]
        hidden = model(step_ids, step_pos, step, copies)
        outs.append((model.compute_logits(hidden), copies))
    model.fused_decode = None
    return outs[0][0], outs[1][0], outs[0][1], outs[1][1]


@contextlib.contextmanager
def activations(act: int):
    """The process default precision of 8-bit and packed codes' activations at decode (0: leave it): the fused
    stack's quantized linears take it (kernels/linear/cpu_quant_int8dot.h)."""
    ops = _ops()
    if not act or not hasattr(ops, "quant_int8_dot"):
        yield
        return
    mode, _, before = ops.quant_int8_dot()
    ops.quant_int8_dot(-1, act)
    try:
        yield
    finally:
        ops.quant_int8_dot(-1, before)


CASES = [  # (dtype, quantization, activations of 8-bit codes (0: the default), rtol/atol of the logits)
    pytest.param(torch.float32, None, 0, 1e-5, id="packed-fp32"),
    pytest.param(torch.bfloat16, None, 0, 0.0, id="packed-bf16",
                 marks=pytest.mark.skipif(not can_pack(CPU, torch.bfloat16), reason="oneDNN has no bf16 here")),
    pytest.param(torch.float32, "int8", 32, 1e-5, id="int8-fp32"),
    # int16 activations (the default on a VNNI CPU): RMSNorm's ~1e-7 difference can move an element
    # across a rounding boundary, one step of max|x| / 32767 of its block: 1-2 of ~20k logits and
    # cache entries differ by 1e-4 to 3.3e-4, the rest by < 4e-5
    pytest.param(torch.float32, "int8", 16, 1e-3, id="int8-fp32-int16act"),
    pytest.param(torch.float32, "int4", 32, 1e-5, id="int4-fp32"),
    pytest.param(torch.float32, "int4", 16, 1e-3, id="int4-fp32-int16act"),  # packed codes too, as above
    # bf16: the same linears and attention, but RMSNorm's fp32 sum in another order can round one element
    # to the neighbouring bf16 value, which moves its block's int16 activations: the logits then differ
    # by a bf16 ulp here and there (1 of 16 data seeds with fp32 prefill rows, 3 of 16 with int16 ones)
    pytest.param(torch.bfloat16, "int8", 0, 2.0**-7, id="int8-bf16"),
]


@pytest.mark.parametrize("dtype, quantization, act, tol", CASES)
@pytest.mark.parametrize("contexts", [[7], [5, 40, 17], [3 + 2 * i for i in range(17)]], ids=["b1", "b3", "b17"])
def test_fused_step_matches_the_module_loop(tiny_model_dir, dtype, quantization, act, tol, contexts):
    model, cfg, fused = build(tiny_model_dir, dtype, quantization)
    with activations(act):
        got, expected, got_caches, expected_caches = decode_both_ways(model, cfg, fused, contexts)
    assert got.shape == (len(contexts), cfg.vocab_size)
    # fp32: only RMSNorm's summation order and FMA contraction differ (~1e-7 relative per op);
    # bf16: every element-wise step rounds where the aten ops round, and the linears and attention
    # are the same functions, so the step is the same bits.
    torch.testing.assert_close(got, expected, rtol=tol, atol=tol)
    for (k1, v1), (k2, v2) in zip(got_caches, expected_caches, strict=True):
        torch.testing.assert_close(k1, k2, rtol=tol, atol=tol)
        torch.testing.assert_close(v1, v2, rtol=tol, atol=tol)
    assert torch.equal(got.argmax(-1), expected.argmax(-1))


def routed_to_fused(model, attn: AttentionMetadata, rows: int) -> bool:
    """Whether LlamaForCausalLM.forward hands a step of `rows` rows to its fused op (a spy in its
    place: nothing is computed)."""
    calls = []
    model.fused_decode = lambda x, positions, attn, kv_caches: calls.append(x.shape[0]) or x
    try:
        model(torch.zeros(rows, dtype=torch.long), torch.arange(rows), attn, [])
    finally:
        model.fused_decode = None
    return calls == [rows]


@pytest.mark.parametrize("dtype, quantization, act, tol", CASES)
def test_small_multi_token_step_matches_the_module_loop(tiny_model_dir, dtype, quantization, act, tol):
    """Speculative verification's shape (6 rows for one sequence, 4 for another) beside a decode
    row and a 9-token chunk: the op's attention applies the causal mask within each sequence."""
    model, cfg, fused = build(tiny_model_dir, dtype, quantization)
    new_tokens = [6, 1, 4, 9]
    assert routed_to_fused(model, meta([8] * 4, new_tokens, torch.zeros(4, 1, dtype=torch.int32)), sum(new_tokens))
    with activations(act):
        got, expected, got_caches, expected_caches = decode_both_ways(model, cfg, fused, [12, 30, 5, 0], new_tokens)
    assert got.shape == (sum(new_tokens), cfg.vocab_size)
    torch.testing.assert_close(got, expected, rtol=tol, atol=tol)
    for (k1, v1), (k2, v2) in zip(got_caches, expected_caches, strict=True):
        torch.testing.assert_close(k1, k2, rtol=tol, atol=tol)
        torch.testing.assert_close(v1, v2, rtol=tol, atol=tol)
    # a large prefill runs fused too: one path for every step (issue 32, tests/worker/test_row_invariance.py)
    assert routed_to_fused(model, meta([200], [200], torch.zeros(1, 13, dtype=torch.int32)), 200)


@pytest.mark.parametrize("kind", ["llama", "qwen2", "mistral"])
def test_fused_step_matches_the_module_loop_across_families(kind, tmp_path):
    """Llama 3's scaled RoPE, Qwen2's q/k/v bias and tied head, Mistral: HF checkpoints of each."""
    from tests.worker.hf_models import build_hf_model

    model, cfg, fused = build(str(build_hf_model(kind, tmp_path, seed=3)), torch.float32, None)
    got, expected, _, _ = decode_both_ways(model, cfg, fused, [9, 30])
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_refusals(tiny_model_dir, monkeypatch):
    model, _ = load_model(tiny_model_dir, torch.float32, CPU)
    setting = Setting(CPU, torch.float32, torch.float32, "cpu")
    assert fused_decode_for(model, setting)[0] is not None  # plain nn.Linear: at::linear inside
    for other, why in [(Setting(CPU, torch.float32, torch.float32, "torch"), "compiled attention"),
                       (Setting(CPU, torch.float32, torch.float8_e4m3fn, "cpu"), "same dtype"),
                       (Setting(CPU, torch.float32, torch.float32, "cpu", lora=True), "LoRA"),
                       (Setting(CPU, torch.float32, torch.float32, "cpu", tensor_parallel_size=2), "tensor")]:
        fused, reason = fused_decode_for(model, other)
        assert fused is None and why in reason
    model.model.layers[1].mlp.down_proj = torch.nn.Sequential(model.model.layers[1].mlp.down_proj)
    assert fused_decode_for(model, setting) == (None, "no fused path for a Sequential projection")
    monkeypatch.setenv(ENV_SWITCH, "0")
    assert fused_decode_for(model, setting) == (None, f"{ENV_SWITCH}=0")


def generate(model_dir: str, prompts: list[list[int]]) -> tuple[list[list[int]], bool]:
    llm = LLM(model=model_dir, dtype="float32", max_num_seqs=4)
    try:
        out = llm.generate([{"prompt_token_ids": p} for p in prompts],
                           SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True), use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in out], llm.runner.model.fused_decode is not None
    finally:
        llm.close()


def test_greedy_tokens_identical_with_the_path_on_and_off(tiny_model_dir, monkeypatch):
    # more prompts than max_num_seqs: decode batches of 1..4 rows, and prefills between them
    prompts = [list(range(3 + i, 3 + i + n)) for i, n in enumerate([5, 33, 12, 70, 2, 19])]
    monkeypatch.setenv(ENV_SWITCH, "1")
    on, fused_on = generate(tiny_model_dir, prompts)
    monkeypatch.setenv(ENV_SWITCH, "0")
    off, fused_off = generate(tiny_model_dir, prompts)
    assert fused_on and not fused_off
    assert on == off
