"""GGUF loading on tiny files written with gguf.GGUFWriter: dequantisation against gguf's own
dequantiser, llama.cpp's tensor names and q/k permutation for every family (fused Phi-3, OLMo 2,
Granite, stacked mixture-of-experts), and the errors for what is unsupported."""

from __future__ import annotations

import dataclasses

import gguf
import numpy as np
import pytest
import torch
import transformers

from tests.worker.gguf_files import GGUF_ARCH, Q, hf_to_gguf, write_gguf
from tests.worker.hf_models import VOCAB, PagedSequence, build_hf_model, hf_logits
from worker_svc.model_loader import gguf_loader
from worker_svc.model_loader.errors import UnsupportedModelError
from worker_svc.model_loader.gguf_loader import UnsupportedTensorTypeError
from worker_svc.model_loader.loader import load_model, resolve_dtype
from worker_svc.model_loader.model_config import ModelConfig
from worker_svc.parallel.distributed import TensorParallel

SUPPORTED = "supported: F32, F16, BF16, Q4_0, Q4_1, Q8_0, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K"


# -- dequantisation: bit-identical to gguf.quants.dequantize -------------------------------------

@pytest.mark.parametrize("type_name", list(gguf_loader.DEQUANTISERS))
def test_dequantize_matches_gguf_on_every_bit_pattern(type_name):
    # Random bytes reach every nibble, scale, minimum, subnormal, inf and NaN a block can hold.
    qtype = Q[type_name]
    block, type_size = gguf.GGML_QUANT_SIZES[qtype]
    rows, cols = 24, 256
    raw = np.random.default_rng(qtype.value).integers(0, 256, (rows, cols // block * type_size), np.uint8)
    with np.errstate(invalid="ignore", over="ignore"):
        expected = gguf.quants.dequantize(raw, qtype)
    ours = gguf_loader.dequantize(raw, type_name, (rows, cols))
    assert ours.dtype == torch.float32 and tuple(ours.shape) == expected.shape == (rows, cols)
    np.testing.assert_array_equal(ours.numpy(), expected.astype(np.float32))  # NaN == NaN here


@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q4_1, Q.Q8_0, Q.F16, Q.BF16])
def test_dequantize_of_real_weights_is_close(qtype):
    weights = np.random.default_rng(0).normal(0, 0.05, (16, 256)).astype(np.float32)
    stored = gguf.quants.quantize(weights, qtype)
    ours = gguf_loader.dequantize(stored, qtype.name, weights.shape)
    tol = {Q.Q4_0: 0.02, Q.Q4_1: 0.02, Q.Q8_0: 1e-3, Q.F16: 1e-4, Q.BF16: 1e-3}[qtype]
    np.testing.assert_allclose(ours.numpy(), weights, atol=tol)


def test_unsupported_tensor_type_names_the_supported_ones(tmp_path):
    with pytest.raises(UnsupportedTensorTypeError, match=f"unsupported GGUF tensor type: Q3_K; {SUPPORTED}"):
        gguf_loader.dequantize(np.zeros(110, np.uint8), "Q3_K", (256,))
    _, path = hf_to_gguf("qwen2", tmp_path, types={"model.layers.1.mlp.up_proj.weight": Q.IQ4_NL})
    with pytest.raises(UnsupportedTensorTypeError, match=f"unsupported GGUF tensor type: IQ4_NL; {SUPPORTED}"):
        load_model(path, torch.float32, "cpu")


# -- the file: config, names, permutation ---------------------------------------------------------

@pytest.mark.parametrize("kind", list(GGUF_ARCH))
def test_gguf_loads_exactly_what_the_hf_directory_holds(kind, tmp_path):
    hf_dir, path = hf_to_gguf(kind, tmp_path)
    ours, cfg = load_model(path, torch.float32, "cpu")
    reference, hf_cfg = load_model(hf_dir, torch.float32, "cpu")
    # The same parsed config; GGUF stores floats (epsilon, Granite's multipliers) as float32, and
    # Mistral as "llama" (Mixtral too, but its experts make it Mixtral again).
    assert cfg.architecture == ("LlamaForCausalLM" if kind == "mistral" else hf_cfg.architecture)
    floats = {f.name for f in dataclasses.fields(cfg) if isinstance(getattr(hf_cfg, f.name), float)}
    for name in floats:
        assert getattr(cfg, name) == pytest.approx(getattr(hf_cfg, name), rel=1e-6), name
    assert dataclasses.replace(cfg, architecture=hf_cfg.architecture,
                               **{name: getattr(hf_cfg, name) for name in floats}) == hf_cfg
    ref_params = dict(reference.named_parameters())
    for name, param in ours.named_parameters():
        assert torch.equal(param, ref_params[name]), name
    assert (ours.lm_head.weight is ours.model.embed_tokens.weight) == cfg.tie_word_embeddings


NEW_TOKENS = 12


def _greedy(model, cfg, prompt: list[int]) -> list[int]:
    seq = PagedSequence(model, cfg, len(prompt) + NEW_TOKENS, seed=3)
    logits, out = seq.step(prompt), []
    for _ in range(NEW_TOKENS):
        out.append(int(logits[-1].argmax()))
        logits = seq.step(out[-1:])
    return out


def _hf_greedy(model_dir, prompt: list[int]) -> list[int]:
    model = transformers.AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32, attn_implementation="eager").eval()
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(NEW_TOKENS):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt):]


@pytest.mark.parametrize("kind", ["phi3", "olmo2", "granite", "mixtral", "qwen3_moe", "olmoe"])
def test_gguf_greedy_tokens_match_the_hf_directory_and_transformers(kind, tmp_path):
    # Each family's own layout: Phi-3's fused attn_qkv / ffn_up, OLMo 2's post-norms, Granite's
    # scalings and permuted q/k, the experts stacked (Mixtral's under arch "llama", permuted).
    hf_dir, path = hf_to_gguf(kind, tmp_path)
    prompt = torch.randint(3, VOCAB, (19,), generator=torch.Generator().manual_seed(11)).tolist()
    model, cfg = load_model(path, torch.float32, "cpu")
    # every prompt position's logits, not only the argmax (a random model may repeat one token)
    logits = PagedSequence(model, cfg, len(prompt), seed=4).step(prompt)
    assert (logits - hf_logits(hf_dir, prompt)).abs().max().item() < 1e-4
    tokens = _greedy(model, cfg, prompt)
    assert tokens == _greedy(*load_model(hf_dir, torch.float32, "cpu"), prompt)
    assert tokens == _hf_greedy(hf_dir, prompt)


def test_mixture_of_experts_config_from_the_metadata(tmp_path):
    cfg = ModelConfig.from_dir(hf_to_gguf("qwen3_moe", tmp_path)[1])
    # expert_feed_forward_length; the layer without ffn_gate_inp is dense; llama.cpp renormalises
    assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size, cfg.intermediate_size,
            cfg.mlp_only_layers, cfg.norm_topk_prob) == (8, 2, 32, 128, (1,), True)
    mixtral = ModelConfig.from_dir(hf_to_gguf("mixtral", tmp_path)[1])
    assert (mixtral.architecture, mixtral.num_experts, mixtral.moe_intermediate_size, mixtral.norm_topk_prob) \
        == ("MixtralForCausalLM", 8, 64, True)
    assert ModelConfig.from_dir(hf_to_gguf("olmoe", tmp_path)[1]).norm_topk_prob is False


def test_quantised_matrices_dequantise_into_the_compute_dtype(tmp_path):
    types = {f"model.layers.{i}.{m}.weight": t for i in range(2)
             for m, t in (("self_attn.q_proj", Q.Q4_0), ("self_attn.k_proj", Q.Q4_1),
                          ("mlp.down_proj", Q.Q8_0), ("self_attn.o_proj", Q.F16), ("mlp.up_proj", Q.BF16))}
    hf_dir, path = hf_to_gguf("mistral", tmp_path, types)
    assert resolve_dtype("auto", ModelConfig.from_dir(path)) == torch.float32  # mixed types
    model, cfg = load_model(path, torch.bfloat16, "cpu")
    reference, _ = load_model(hf_dir, torch.float32, "cpu")
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    q = cfg.num_heads * cfg.head_dim
    ours = model.model.layers[1].self_attn.qkv_proj.weight[:q].float()
    expected = reference.model.layers[1].self_attn.qkv_proj.weight[:q]
    torch.testing.assert_close(ours, expected, atol=0.05, rtol=0)  # Q4_0 of 0.08-std weights
    assert (ours - expected).abs().mean() < 0.01  # permutation undone: rows line up


def test_quantised_stacked_experts_dequantise_per_expert(tmp_path):
    hf_dir = build_hf_model("mixtral", tmp_path / "hf")
    path = write_gguf(tmp_path / "q.gguf", hf_dir, "llama", {"blk.1.ffn_down_exps.weight": Q.Q8_0})
    model, _ = load_model(path, torch.float32, "cpu")
    reference, _ = load_model(hf_dir, torch.float32, "cpu")
    ours, expected = (m.model.layers[1].mlp.experts.down_proj for m in (model, reference))
    torch.testing.assert_close(ours, expected, atol=2e-3, rtol=0)  # Q8_0 of 0.08-std weights
    assert not torch.equal(ours, expected)  # it was quantised
    assert torch.equal(model.model.layers[0].mlp.experts.down_proj, reference.model.layers[0].mlp.experts.down_proj)


@pytest.mark.parametrize("kind", ["qwen2", "phi3", "mixtral", "qwen3_moe"])
def test_tensor_parallel_rank_gets_the_same_slices_from_both_formats(kind, tmp_path):
    hf_dir, path = hf_to_gguf(kind, tmp_path)
    tp = TensorParallel(rank=1, size=2)
    ours, _ = load_model(path, torch.float32, "cpu", tp)
    reference, _ = load_model(hf_dir, torch.float32, "cpu", tp)
    ref_params = dict(reference.named_parameters())
    for name, param in ours.named_parameters():
        assert torch.equal(param, ref_params[name]), name


def test_unsupported_architecture_is_a_clear_error(tmp_path):
    _, path = hf_to_gguf("qwen2", tmp_path)
    tensors = {t.name: t for t in gguf.GGUFReader(str(path)).tensors}
    writer = gguf.GGUFWriter(str(tmp_path / "gpt2.gguf"), "gpt2")
    writer.add_tensor("token_embd.weight", np.asarray(tensors["token_embd.weight"].data))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(UnsupportedModelError, match="unsupported GGUF architecture 'gpt2'; supported: "
                       "llama, qwen2, qwen3, phi3, olmo2, granite, qwen3moe, olmoe$"):
        load_model(tmp_path / "gpt2.gguf", torch.float32, "cpu")


def _copy_with(src, dst, keys=None, tensors=None):
    """The GGUF `src` rewritten as `dst` with `keys` ({name: (value, GGUFValueType)}) set and
    `tensors` ({name: float32 array}) added."""
    reader = gguf.GGUFReader(str(src))
    writer = gguf.GGUFWriter(str(dst), reader.get_field("general.architecture").contents())
    for field in reader.fields.values():
        if not field.name.startswith("GGUF.") and field.name not in (keys or {}) \
                and field.name != "general.architecture":
            array = field.types[0] == gguf.GGUFValueType.ARRAY
            writer.add_key_value(field.name, field.contents(), field.types[0], field.types[-1] if array else None)
    for name, (value, vtype) in (keys or {}).items():
        writer.add_key_value(name, value, vtype)
    for t in reader.tensors:
        writer.add_tensor(t.name, np.asarray(t.data), raw_dtype=t.tensor_type)
    for name, array in (tensors or {}).items():
        writer.add_tensor(name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return dst


def test_partial_rotary_is_phi3s_alone(tmp_path):
    _, phi3 = hf_to_gguf("phi3", tmp_path)
    assert ModelConfig.from_dir(phi3).rotary_dim == 8  # of 16: phi3.rope.dimension_count
    _, mistral = hf_to_gguf("mistral", tmp_path)
    partial = _copy_with(mistral, tmp_path / "partial.gguf",
                         keys={"llama.rope.dimension_count": (8, gguf.GGUFValueType.UINT32)})
    with pytest.raises(UnsupportedModelError,
                       match=r"partial rotary \(8 of 16 dims\) is not supported for GGUF architecture 'llama'"):
        ModelConfig.from_dir(partial)


def test_phi3_longrope_and_olmoe_clip_qkv_are_refused(tmp_path):
    _, phi3 = hf_to_gguf("phi3", tmp_path)
    longrope = _copy_with(phi3, tmp_path / "longrope.gguf",
                          tensors={"rope_factors_long.weight": np.ones(4, np.float32),
                                   "rope_factors_short.weight": np.ones(4, np.float32)})
    with pytest.raises(UnsupportedModelError, match="rope_factors_long \\(Phi-3 LongRoPE scaling\\)"):
        ModelConfig.from_dir(longrope)
    _, olmoe = hf_to_gguf("olmoe", tmp_path)
    clip = _copy_with(olmoe, tmp_path / "clip.gguf",
                      keys={"olmoe.attention.clamp_kqv": (8.0, gguf.GGUFValueType.FLOAT32)})
    assert ModelConfig.from_dir(olmoe).num_experts == 8  # the file without the key loads
    with pytest.raises(UnsupportedModelError, match="attention.clamp_kqv \\(clip_qkv\\) is not supported"):
        ModelConfig.from_dir(clip)


def test_missing_model_path_names_both_formats(tmp_path):
    with pytest.raises(FileNotFoundError, match="HF-format directory or a .gguf file"):
        ModelConfig.from_dir(tmp_path / "absent.gguf")


def test_a_load_parses_the_file_once_and_lets_it_go(tmp_path, monkeypatch):
    # Opening a GGUF parses its header: config, the names kept quantized and the tensors share one
    # reader (gguf_file.GGUFFile), dropped when the model is loaded; outside a load no reader is kept.
    from worker_svc.model_loader import gguf_file

    types = {f"model.layers.{i}.mlp.down_proj.weight": Q.Q8_0 for i in range(2)}
    _, path = hf_to_gguf("mistral", tmp_path, types)
    opened = []
    real = gguf_file.GGUFFile
    monkeypatch.setattr(gguf_file, "GGUFFile", lambda p, *a, **k: opened.append(p) or real(p, *a, **k))
    gguf_loader._cached_config.cache_clear()
    load_model(path, torch.float32, "cpu", quantization="gguf")
    assert opened == [str(path.resolve())]
    assert gguf_loader._shared is None
    gguf_loader.quantized_names(path)
    assert len(opened) == 2 and gguf_loader._shared is None

