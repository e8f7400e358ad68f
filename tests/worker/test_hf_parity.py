"""fp32 logits of our paged model == HF transformers' eager logits, for every supported architecture."""

from __future__ import annotations

import pytest
import torch

from tests.worker.hf_models import ARCHITECTURES, VOCAB, PagedSequence, build_hf_model, hf_logits
from worker_svc.model_loader.loader import load_model
from worker_svc.models import moe
from worker_svc.models.packed_linear import can_pack, pack_linear_weights

PROMPT_LEN = 37


@pytest.fixture(scope="module", params=ARCHITECTURES)
def checkpoint(request, tmp_path_factory):
    kind = request.param
    model_dir = build_hf_model(kind, tmp_path_factory.mktemp(kind))
    prompt = torch.randint(3, VOCAB, (PROMPT_LEN,), generator=torch.Generator().manual_seed(7)).tolist()
    model, cfg = load_model(model_dir, torch.float32, "cpu")
    if can_pack(torch.device("cpu")):  # what the worker serves with on CPU (TP keeps plain weights)
        # qkv, o, and gate_up + down (dense) or the router (MoE; the experts stay stacked), + lm_head
        mlp_linears = sum(1 if cfg.is_moe_layer(i) else 2 for i in range(cfg.num_layers))
        assert pack_linear_weights(model) == 2 * cfg.num_layers + mlp_linears + 1
    return kind, model, cfg, prompt, hf_logits(model_dir, prompt)


def test_config_flags_follow_architecture(checkpoint):
    kind, _, cfg, _, _ = checkpoint
    assert cfg.qkv_bias == (kind in ("qwen2", "qwen2_swa"))
    # per head; OLMo 2's / OLMoE's are their layers'
    assert cfg.qk_norm == (kind in ("qwen3", "qwen3_moe", "gemma3"))
    moe = {"mixtral": (8, 2, 64, True, ()), "qwen3_moe": (8, 2, 32, True, (1,)), "olmoe": (8, 2, 64, False, ())}
    assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size, cfg.norm_topk_prob,
            cfg.mlp_only_layers) == moe.get(kind, (0, 0, 0, False, ()))
    assert [cfg.is_moe_layer(i) for i in range(cfg.num_layers)] == (
        [True, False, True] if kind == "qwen3_moe" else [kind in moe] * cfg.num_layers)
    assert cfg.tie_word_embeddings == (kind in ("qwen2", "qwen2_swa", "granite", "gemma2", "gemma3"))
    windows = {"mistral_swa": (16, 16), "qwen2_swa": (None, 12, 12), "gemma2": (16, None),
               "gemma3": (16, None, 16)}
    assert [cfg.layer_window(i) for i in range(cfg.num_layers)] == list(windows.get(kind, (None,) * cfg.num_layers))
    assert (cfg.rope_scaling or {}).get("rope_type") == {"llama": "llama3", "gemma3": "linear"}.get(kind)
    assert cfg.local_rope_theta == (100.0 if kind == "gemma3" else None)
    gemma = kind in ("gemma2", "gemma3")
    assert cfg.hidden_act == ("gelu_pytorch_tanh" if gemma else "silu")
    assert (cfg.attn_logit_softcapping, cfg.final_logit_softcapping) == {
        "gemma2": (1.5, 4.0), "gemma3": (None, 4.0)}.get(kind, (None, None))
    assert cfg.rotary_dim == (cfg.head_dim // 2 if kind == "phi3" else cfg.head_dim)
    granite = (12.0, 0.22, 0.1, 8.0) if kind == "granite" else (1.0, 1.0, 24**-0.5 if gemma else None, 1.0)
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


def test_moe_experts_run_one_matmul_pair_per_expert_not_per_token(checkpoint, monkeypatch):
    """A 200-token batch through an MoE layer: at most 2 matmuls (gate_up, down) per expert that got
    tokens, never one per token or per (token, expert) pair; and the same output as routing each
    token by hand."""
    kind, model, cfg, _, _ = checkpoint
    if not cfg.num_experts:
        pytest.skip("dense model")
    calls: list[int] = []

    def counting(x, weight):
        calls.append(x.shape[0])
        return torch.nn.functional.linear(x, weight)

    monkeypatch.setattr(moe, "expert_linear", counting)
    layer = next(layer.mlp for i, layer in enumerate(model.model.layers) if cfg.is_moe_layer(i))
    x = torch.randn(200, cfg.hidden_size, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        got = layer(x)
    assert len(calls) <= 2 * cfg.num_experts and sum(calls) == 2 * 200 * cfg.num_experts_per_tok
    with torch.no_grad():
        probs = torch.softmax(layer.gate(x), dim=-1)  # the router (maybe packed) is not under test
        weights, chosen = probs.topk(cfg.num_experts_per_tok, dim=-1)
        if cfg.norm_topk_prob:
            weights = weights / weights.sum(-1, keepdim=True)
        expected = torch.zeros_like(x)
        for t in range(x.shape[0]):  # the per-token reference the layer must not be
            for w, e in zip(weights[t], chosen[t], strict=True):
                gate, up = (layer.experts.gate_up_proj[e] @ x[t]).chunk(2)
                expected[t] += w * (layer.experts.down_proj[e] @ (torch.nn.functional.silu(gate) * up))
    assert (got - expected).abs().max().item() < 1e-5
