"""fp32 logits of our paged model == HF transformers' eager logits, for every supported architecture."""

from __future__ import annotations

import pytest
import torch

from tests.worker.hf_models import ARCHITECTURES, VOCAB, PagedSequence, build_hf_model, hf_logits
from worker_svc.model_loader.loader import load_model
from worker_svc.models.packed_linear import can_pack, pack_linear_weights

PROMPT_LEN = 37


@pytest.fixture(scope="module", params=ARCHITECTURES)
def checkpoint(request, tmp_path_factory):
    kind = request.param
    model_dir = build_hf_model(kind, tmp_path_factory.mktemp(kind))
    prompt = torch.randint(3, VOCAB, (PROMPT_LEN,), generator=torch.Generator().manual_seed(7)).tolist()
    model, cfg = load_model(model_dir, torch.float32, "cpu")
    if can_pack(torch.device("cpu")):  # what the worker serves with on CPU (TP keeps plain weights)
        assert pack_linear_weights(model) == 4 * cfg.num_layers + 1
    return kind, model, cfg, prompt, hf_logits(model_dir, prompt)


def test_config_flags_follow_architecture(checkpoint):
    kind, _, cfg, _, _ = checkpoint
    assert cfg.qkv_bias == (kind == "qwen2")
    assert cfg.qk_norm == (kind == "qwen3")  # per head; OLMo 2's whole-q/k norms are its own layer's
    assert cfg.tie_word_embeddings == (kind in ("qwen2", "granite"))
    assert (cfg.rope_scaling or {}).get("rope_type") == ("llama3" if kind == "llama" else None)
    assert cfg.rotary_dim == (cfg.head_dim // 2 if kind == "phi3" else cfg.head_dim)
    granite = (12.0, 0.22, 0.1, 8.0) if kind == "granite" else (1.0, 1.0, None, 1.0)
    assert (cfg.embedding_multiplier, cfg.residual_multiplier, cfg.attention_multiplier,
            cfg.logits_scaling) == granite
    assert cfg.eos_token_ids == (2,)


def test_whole_prompt_matches_hf(checkpoint):
    _, model, cfg, prompt, expected = checkpoint
    logits = PagedSequence(model, cfg, PROMPT_LEN, seed=1).step(prompt)
    assert (logits - expected).abs().max().item() < 1e-4


@pytest.mark.parametrize("chunks", [(20, 17), (8, 16, 12, 1)])
def test_chunked_prefill_then_decode_matches_hf(checkpoint, chunks):
    _, model, cfg, prompt, expected = checkpoint
    seq = PagedSequence(model, cfg, PROMPT_LEN, seed=2)
    starts = [sum(chunks[:i]) for i in range(len(chunks))]
    logits = torch.cat([seq.step(prompt[s:s + n]) for s, n in zip(starts, chunks, strict=True)])
    assert (logits - expected).abs().max().item() < 1e-4
