"""GGUF loading on tiny files written with gguf.GGUFWriter: dequantisation against gguf's own
dequantiser, llama.cpp's tensor names and q/k permutation, and the errors for what is unsupported."""

from __future__ import annotations

import dataclasses

import gguf
import numpy as np
import pytest
import torch

from tests.worker.gguf_files import GGUF_ARCH, Q, hf_to_gguf
from worker_svc.distributed import TensorParallel
from worker_svc.model_loader import gguf_loader
from worker_svc.model_loader.errors import UnsupportedModelError
from worker_svc.model_loader.gguf_loader import UnsupportedTensorTypeError
from worker_svc.model_loader.loader import load_model, resolve_dtype
from worker_svc.model_loader.model_config import ModelConfig

SUPPORTED = "supported: F32, F16, BF16, Q4_0, Q4_1, Q8_0"


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
    with pytest.raises(UnsupportedTensorTypeError, match=f"unsupported GGUF tensor type: Q4_K; {SUPPORTED}"):
        gguf_loader.dequantize(np.zeros(144, np.uint8), "Q4_K", (256,))
    _, path = hf_to_gguf("qwen2", tmp_path, types={"model.layers.1.mlp.up_proj.weight": Q.Q5_0})
    with pytest.raises(UnsupportedTensorTypeError, match=f"unsupported GGUF tensor type: Q5_0; {SUPPORTED}"):
        load_model(path, torch.float32, "cpu")


# -- the file: config, names, permutation ---------------------------------------------------------

@pytest.mark.parametrize("kind", list(GGUF_ARCH))
def test_gguf_loads_exactly_what_the_hf_directory_holds(kind, tmp_path):
    hf_dir, path = hf_to_gguf(kind, tmp_path)
    ours, cfg = load_model(path, torch.float32, "cpu")
    reference, hf_cfg = load_model(hf_dir, torch.float32, "cpu")
    # The same parsed config; GGUF stores the epsilon as a float32, and Mistral as "llama".
    assert cfg.rms_norm_eps == pytest.approx(hf_cfg.rms_norm_eps, rel=1e-6)
    assert cfg.architecture == gguf_loader.GGUF_ARCHITECTURES[GGUF_ARCH[kind]]
    assert dataclasses.replace(cfg, rms_norm_eps=hf_cfg.rms_norm_eps, architecture=hf_cfg.architecture) == hf_cfg
    ref_params = dict(reference.named_parameters())
    for name, param in ours.named_parameters():
        assert torch.equal(param, ref_params[name]), name
    assert (ours.lm_head.weight is ours.model.embed_tokens.weight) == cfg.tie_word_embeddings


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


def test_tensor_parallel_rank_gets_the_same_slices_from_both_formats(tmp_path):
    hf_dir, path = hf_to_gguf("qwen2", tmp_path)
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
    with pytest.raises(UnsupportedModelError, match="unsupported GGUF architecture 'gpt2'; supported: llama, qwen2, qwen3"):
        load_model(tmp_path / "gpt2.gguf", torch.float32, "cpu")


def test_missing_model_path_names_both_formats(tmp_path):
    with pytest.raises(FileNotFoundError, match="HF-format directory or a .gguf file"):
        ModelConfig.from_dir(tmp_path / "absent.gguf")
