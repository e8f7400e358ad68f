"""Quantized models at load (docs/quantization.md): a GGUF's quantized linears served as stored
(every type, on small files written with gguf.GGUFWriter), `--quantization int8|int4` for an HF
directory, the refusals, and SmolLM2 end to end against HF transformers."""

from __future__ import annotations

import contextlib

import pytest
import torch
import transformers

from pagoda import LLM, SamplingParams
from tests.smollm2_fixtures import MAX_TOKENS, REPO
from tests.worker.gguf_files import Q, write_gguf
from tests.worker.hf_models import PagedSequence
from worker_svc.config import WorkerConfig
from worker_svc.model_loader import gguf_quants
from worker_svc.model_loader.loader import load_model
from worker_svc.model_runner import ModelRunner
from worker_svc.models.quant_linear import QuantEmbedding, QuantLinear, _ops, interleaving_default
from worker_svc.parallel.distributed import TensorParallel

LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _hf_dir(tmp_path, tied: bool):
    """A 2-layer Llama whose rows are 256 wide (the K-quants' block): GQA 4/2, permuted q/k in GGUF."""
    config = transformers.LlamaConfig(vocab_size=256, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                                      tie_word_embeddings=tied, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    out = tmp_path / ("tied" if tied else "untied")
    model.save_pretrained(out)
    return out


def _types(qtype, tied: bool, head=None) -> dict:
    types = {f"model.layers.{i}.{'self_attn' if m[0] in 'qkvo' else 'mlp'}.{m}.weight": qtype
             for i in range(2) for m in LINEARS}
    types["model.embed_tokens.weight"] = head or qtype
    if not tied:
        types["lm_head.weight"] = head or qtype
    return types


@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("type_name", list(gguf_quants.DECODERS))
def test_gguf_linears_are_served_as_stored(type_name, tied, tmp_path):
    hf_dir = _hf_dir(tmp_path, tied)
    path = write_gguf(tmp_path / "m.gguf", hf_dir, "llama", _types(Q[type_name], tied))
    quant, cfg = load_model(path, torch.float32, "cpu", quantization="gguf")
    dense, _ = load_model(path, torch.float32, "cpu")  # the same file, dequantised (bit-exact decoders)
    modules = dict(quant.named_modules())
    for name, module in dense.named_modules():
        if isinstance(module, torch.nn.Linear):  # every projection and the head: quantized, same weights
            assert isinstance(modules[name], QuantLinear), name
            assert torch.equal(modules[name].dequantized_weight(), module.weight), name
    assert isinstance(quant.model.embed_tokens, QuantEmbedding)  # untied: its own quantized table (issue 47)
    ids = torch.tensor([5, 200, 17, 255])
    assert torch.equal(quant.model.embed_tokens(ids), dense.model.embed_tokens(ids))
    # stored bytes: the file's, fp32 scales instead of fp16 ones (nothing widened to fp32 weights)
    assert sum(b.numel() * b.element_size() for b in quant.buffers()) < 0.4 * sum(
        p.numel() * p.element_size() for p in dense.parameters())
    prompt = [1, 40, 41, 42, 43, 44, 45, 46, 47]
    b = PagedSequence(dense, cfg, 16, seed=0).step(prompt)
    with _activations(32):  # fp32 activations: only the summation order differs
        torch.testing.assert_close(PagedSequence(quant, cfg, 16, seed=0).step(prompt), b, rtol=1e-4, atol=1e-4)
    # the default (int16 activations per 32 on a VNNI CPU): each element within 1/65534 of its block's max
    a = PagedSequence(quant, cfg, 16, seed=0).step(prompt)
    assert (a - b).abs().max() <= 1e-3 * b.abs().max()


@contextlib.contextmanager
def _activations(bits: int):
    """The op's default activation precision for 8-bit and packed codes, restored after."""
    ops = _ops()
    if ops is None or not hasattr(ops, "quant_int8_dot"):
        yield
        return
    mode, _, act = ops.quant_int8_dot()
    ops.quant_int8_dot(int(mode != 0), bits)
    try:
        yield
    finally:
        ops.quant_int8_dot(int(mode != 0), act)


def test_q4_k_m_mix_fuses_q6_k_parts_exactly(tmp_path):
    hf_dir = _hf_dir(tmp_path, tied=True)
    types = {**_types(Q.Q4_K, True, head=Q.Q6_K), "model.layers.0.self_attn.v_proj.weight": Q.Q6_K,
             "model.layers.1.mlp.down_proj.weight": Q.Q6_K}  # what llama-quantize's Q4_K_M does
    path = write_gguf(tmp_path / "m.gguf", hf_dir, "llama", types)
    quant, _ = load_model(path, torch.float32, "cpu", quantization="gguf")
    dense, _ = load_model(path, torch.float32, "cpu")
    layers = quant.model.layers
    assert layers[0].self_attn.qkv_proj.weight_q.bits == 8  # Q4_K q/k + Q6_K v: the common int8 g16
    assert layers[1].self_attn.qkv_proj.weight_q.bits == 4  # all Q4_K: stays packed
    assert layers[1].mlp.down_proj.weight_q.bits == 6  # Q6_K alone: its packed 6-bit codes
    assert torch.equal(layers[0].self_attn.qkv_proj.dequantized_weight(),
                       dense.model.layers[0].self_attn.qkv_proj.weight)


def test_float_parts_stay_float(tmp_path):
    hf_dir = _hf_dir(tmp_path, tied=False)
    types = {**_types(Q.Q8_0, False), "model.layers.0.self_attn.k_proj.weight": Q.F16}
    del types["lm_head.weight"]  # F32 head
    quant, _ = load_model(write_gguf(tmp_path / "m.gguf", hf_dir, "llama", types), torch.float32, "cpu",
                          quantization="gguf")
    assert isinstance(quant.model.layers[0].self_attn.qkv_proj, torch.nn.Linear)  # one part F16
    assert isinstance(quant.model.layers[1].self_attn.qkv_proj, QuantLinear)
    assert isinstance(quant.lm_head, torch.nn.Linear)
    assert isinstance(quant.model.embed_tokens, QuantEmbedding)  # the Q8_0 token_embd stays quantized


@pytest.mark.parametrize("method", ["int8", "int4"])
def test_hf_directory_quantized_at_load(method, tmp_path):
    hf_dir = _hf_dir(tmp_path, tied=True)
    quant, cfg = load_model(hf_dir, torch.float32, "cpu", quantization=method)
    dense, _ = load_model(hf_dir, torch.float32, "cpu")
    assert isinstance(quant.lm_head, QuantLinear) and isinstance(quant.model.embed_tokens, QuantEmbedding)
    w = quant.model.layers[0].mlp.down_proj
    assert w.weight_q.bits == int(method[3:]) and w.weight_q.group == 32
    err = (w.dequantized_weight() - dense.model.layers[0].mlp.down_proj.weight).abs().max()
    assert 0 < err < (0.003 if method == "int8" else 0.02)  # HF's init: std 0.02


@pytest.mark.parametrize("overrides, message", [
    (dict(device="cuda"), "not supported with a CUDA worker"),
    (dict(enable_lora=True), r"not supported with LoRA \(--enable-lora\)"),
    (dict(tensor_parallel_size=2), "not supported with tensor parallelism"),
])
def test_quantization_refused_where_the_layer_cannot_run(overrides, message, tmp_path):
    hf_dir = _hf_dir(tmp_path, tied=True)
    tp = TensorParallel(rank=0, size=overrides.get("tensor_parallel_size", 1))
    with pytest.raises(ValueError, match=message):
        ModelRunner(WorkerConfig(model=str(hf_dir), quantization="int8", **overrides), tp=tp)


def test_quantization_of_a_gguf_is_refused(tmp_path):
    hf_dir = _hf_dir(tmp_path, tied=True)
    path = write_gguf(tmp_path / "m.gguf", hf_dir, "llama", _types(Q.Q8_0, True))
    with pytest.raises(ValueError, match="a GGUF file"):
        ModelRunner(WorkerConfig(model=str(path), quantization="int4"))


# -- SmolLM2 end to end ---------------------------------------------------------------------------

def _greedy(llm: LLM, chats):
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    return [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": c} for c in chats], params,
                                                           use_tqdm=False)]


def _match_rate(ours, expected) -> float:
    """Tokens equal to HF's, position by position, up to each sequence's first divergence counted
    as the rest mismatching (a divergence changes everything after it)."""
    same = total = 0
    for a, b in zip(ours, expected, strict=True):
        total += len(b)
        for x, y in zip(a, b, strict=False):
            if x != y:
                break
            same += 1
    return same / total


def _hf_greedy(model, chats):
    outs = []
    with torch.no_grad():
        for ids in chats:
            out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                 max_new_tokens=MAX_TOKENS, do_sample=False, pad_token_id=2)
            outs.append(out[0, len(ids):].tolist())
    return outs


@pytest.mark.slow
def test_smollm2_gguf_as_stored_matches_hf_on_the_same_file(smollm2_gguf, chats, hf_greedy):
    with LLM(model=str(smollm2_gguf), dtype="float32", kv_cache_memory_bytes=64 << 20) as llm:
        assert isinstance(llm.runner.model.lm_head, QuantLinear)  # Q4_1 / Q8_0 as stored
        ours = _greedy(llm, chats)
    assert _match_rate(ours, hf_greedy) >= 0.9  # the same weights: only summation order differs


Q4_K_M = REPO / "models" / "gguf" / "smollm2-135m-instruct-Q4_K_M.gguf"  # benchmarks.vs_llamacpp makes it
Q8_0 = REPO / "models" / "gguf" / "smollm2-135m-instruct-Q8_0.gguf"  # and this one


@pytest.mark.slow
@pytest.mark.skipif(not Q8_0.exists(), reason="no Q8_0 file (python -m benchmarks.vs_llamacpp makes it)")
def test_smollm2_q8_0_as_stored_matches_hf_on_the_same_file(chats):
    """Every linear 8-bit: at decode on a VNNI CPU they take int16 activations (the default;
    int8 ones matched 79%), elsewhere the fp32 path."""
    with LLM(model=str(Q8_0), dtype="float32", kv_cache_memory_bytes=64 << 20) as llm:
        layers = llm.runner.model.model.layers
        assert {layer.mlp.down_proj.weight_q.bits for layer in layers} == {8}
        # rows interleaved by 16 where the int16 AVX512-VNNI kernel is the default (interleave_rows)
        assert {layer.mlp.down_proj.weight_q.interleaved for layer in layers} == {interleaving_default()}
        assert llm.runner.model.lm_head.weight_q.interleaved == interleaving_default()
        ours = _greedy(llm, chats)
    hf = transformers.AutoModelForCausalLM.from_pretrained(Q8_0.parent, gguf_file=Q8_0.name, dtype=torch.float32)
    assert _match_rate(ours, _hf_greedy(hf.eval(), chats)) >= 0.9  # 1.0 on 2026-11-26, interleaved


@pytest.mark.slow
@pytest.mark.skipif(not Q4_K_M.exists(), reason="no Q4_K_M file (python -m benchmarks.vs_llamacpp makes it)")
def test_smollm2_q4_k_m_as_stored_matches_the_same_file_dequantised(chats):
    """The Q4_K_M mix (Q5_0 in packed 5-bit codes, Q6_K in 6-bit, Q4_K, Q8_0) against the same
    weights widened to fp32 (`--quantization none`, HF-exact): only the summation order differs."""
    with LLM(model=str(Q4_K_M), dtype="float32", kv_cache_memory_bytes=64 << 20) as llm:
        layers = llm.runner.model.model.layers
        assert {layer.mlp.gate_up_proj.weight_q.bits for layer in layers} == {5}  # Q5_0, packed
        assert {layer.mlp.down_proj.weight_q.bits for layer in layers} == {4, 6}  # Q4_K / Q6_K
        ours = _greedy(llm, chats[:6])  # 6 of the 16 chats: two models' generations, kept short
    with LLM(model=str(Q4_K_M), dtype="float32", quantization="none", kv_cache_memory_bytes=64 << 20) as llm:
        widened = _greedy(llm, chats[:6])
    assert _match_rate(ours, widened) >= 0.9


@pytest.mark.slow
def test_smollm2_int8_at_load_matches_hf_on_the_dequantised_weights(smollm2_dir, chats):
    with LLM(model=str(smollm2_dir), dtype="float32", quantization="int8", kv_cache_memory_bytes=64 << 20) as llm:
        model, cfg = llm.runner.model, llm.runner.model_config
        ours = _greedy(llm, chats)
        hf = transformers.AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()
        q, kv, inter = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.intermediate_size
        with torch.no_grad():
            for layer, theirs in zip(model.model.layers, hf.model.layers, strict=True):
                qkv = layer.self_attn.qkv_proj.dequantized_weight().split([q, kv, kv])
                for w, target in zip(qkv, (theirs.self_attn.q_proj, theirs.self_attn.k_proj,
                                           theirs.self_attn.v_proj), strict=True):
                    target.weight.copy_(w)
                theirs.self_attn.o_proj.weight.copy_(layer.self_attn.o_proj.dequantized_weight())
                gate, up = layer.mlp.gate_up_proj.dequantized_weight().split([inter, inter])
                theirs.mlp.gate_proj.weight.copy_(gate)
                theirs.mlp.up_proj.weight.copy_(up)
                theirs.mlp.down_proj.weight.copy_(layer.mlp.down_proj.dequantized_weight())
            hf.lm_head.weight.copy_(model.lm_head.dequantized_weight())  # tied: the embedding too
    assert _match_rate(ours, _hf_greedy(hf, chats)) >= 0.9
