"""Loader, ModelConfig parsing and the embedded tiny model."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from pagoda.tools import tiny_model
from tests.worker.hf_models import PagedSequence, build_hf_model
from worker_svc.lora.manager import LoRAManager
from worker_svc.model_loader.errors import UnsupportedModelError
from worker_svc.model_loader.loader import WeightLoadError, load_model, resolve_dtype
from worker_svc.model_loader.model_config import ModelConfig
from worker_svc.models.llama import LlamaForCausalLM


@pytest.fixture(scope="module")
def tiny_dir(tiny_model_dir):  # the session's `python -m pagoda.tools.tiny_model` output (conftest.py)
    return Path(tiny_model_dir)


def _hashes(directory):
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(directory.iterdir())}


def test_tiny_model_is_byte_identical_across_generations(tiny_dir, tmp_path):
    again = tmp_path / "again"
    assert tiny_model.write_model(again)
    assert set(_hashes(tiny_dir)) == {"config.json", "generation_config.json", "model.safetensors",
                                      "special_tokens_map.json", "tokenizer.json", "tokenizer_config.json"}
    assert _hashes(again) == _hashes(tiny_dir)
    assert not tiny_model.write_model(again)  # present: skipped
    assert tiny_model.write_model(again, force=True) and _hashes(again) == _hashes(tiny_dir)


def test_tiny_tokenizer_and_chat_template(tiny_dir):
    tok = transformers.AutoTokenizer.from_pretrained(tiny_dir)
    assert len(tok) == 2048 and tok.bos_token_id == 0 and tok.eos_token_id == 1
    ids = tok("The river was quiet.")["input_ids"]
    assert ids[0] == 0 and tok.decode(ids[1:]) == "The river was quiet."
    text = tok.apply_chat_template([{"role": "user", "content": "Hi there"}], add_generation_prompt=True,
                                   tokenize=False)
    assert text == "<|begin_of_text|><|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n"
    assert tok.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>"]) == [2, 3]


def test_tiny_model_matches_hf_and_greedy_does_not_stop(tiny_dir):
    model, cfg = load_model(tiny_dir, torch.float32, "cpu")
    assert (cfg.architecture, cfg.num_kv_heads, cfg.head_dim, cfg.vocab_size) == ("LlamaForCausalLM", 2, 64, 2048)
    assert cfg.eos_token_ids == (1, 3) and resolve_dtype("auto", cfg) == torch.float32
    hf = transformers.AutoModelForCausalLM.from_pretrained(tiny_dir, attn_implementation="eager")
    prompt, new_tokens = [0, 300, 301, 302, 900, 17], 24
    expected = hf.generate(torch.tensor([prompt]), max_new_tokens=new_tokens, do_sample=False,
                           eos_token_id=None, pad_token_id=1)[0, len(prompt):].tolist()
    assert not set(expected) & set(cfg.eos_token_ids)
    seq = PagedSequence(model, cfg, len(prompt) + new_tokens, seed=3, block_size=4)
    generated, logits = [], seq.step(prompt)
    for _ in range(new_tokens):
        generated.append(int(logits[-1].argmax()))
        logits = seq.step(generated[-1:])
    assert generated == expected


def test_bench_preset_has_about_100m_parameters():
    cfg = ModelConfig.from_dict(tiny_model.model_config(tiny_model.PRESETS["bench"]))
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
    assert 90e6 < sum(p.numel() for p in model.parameters()) < 110e6
    assert resolve_dtype("auto", cfg) == torch.bfloat16


def test_unsupported_architecture_names_the_supported_ones(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(UnsupportedModelError) as err:
        load_model(tmp_path, torch.float32, "cpu")
    for name in ("GPT2LMHeadModel", "LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM",
                 "Qwen3ForCausalLM", "Phi3ForCausalLM", "Olmo2ForCausalLM", "GraniteForCausalLM",
                 "MixtralForCausalLM", "Qwen3MoeForCausalLM", "OlmoeForCausalLM"):
        assert name in str(err.value)


def _copy_with_weights(src, dst, mutate):
    shutil.copytree(src, dst)
    weights = load_file(dst / "model.safetensors")
    mutate(weights)
    save_file(weights, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


def test_missing_weight_is_named(tiny_dir, tmp_path):
    broken = _copy_with_weights(tiny_dir, tmp_path / "m", lambda w: w.pop("model.layers.2.self_attn.k_proj.weight"))
    with pytest.raises(WeightLoadError, match=r"model\.layers\.2\.self_attn\.qkv_proj\.weight\[k\]"):
        load_model(broken, torch.float32, "cpu")


def test_unknown_weight_is_named(tiny_dir, tmp_path):
    broken = _copy_with_weights(tiny_dir, tmp_path / "u", lambda w: w.update(extra_thing=torch.zeros(2)))
    with pytest.raises(WeightLoadError, match="unknown weight 'extra_thing'"):
        load_model(broken, torch.float32, "cpu")


def test_shape_mismatch_is_an_error(tiny_dir, tmp_path):
    broken = tmp_path / "s"
    shutil.copytree(tiny_dir, broken)
    config = json.loads((broken / "config.json").read_text())
    config["intermediate_size"] = 512
    (broken / "config.json").write_text(json.dumps(config))
    with pytest.raises(WeightLoadError, match=r"mlp\.\w+_proj\.weight: checkpoint shape \(\d+, \d+\) != model shape"):
        load_model(broken, torch.float32, "cpu")


def test_tied_embeddings_share_one_tensor_and_dtype_is_applied(tmp_path):
    model_dir = build_hf_model("qwen2", tmp_path)
    model, cfg = load_model(model_dir, torch.bfloat16, "cpu")
    assert cfg.tie_word_embeddings
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert all(not p.requires_grad for p in model.parameters())


def test_config_parsing_of_rope_and_eos_variants():
    base = {"architectures": ["LlamaForCausalLM"], "hidden_size": 64, "intermediate_size": 128,
            "num_hidden_layers": 1, "num_attention_heads": 4, "vocab_size": 10, "eos_token_id": 5}
    legacy = ModelConfig.from_dict({**base, "rope_theta": 500000.0, "torch_dtype": "bfloat16",
                                    "rope_scaling": {"type": "llama3", "factor": 8.0}},
                                   {"eos_token_id": [7, 5]})
    assert legacy.rope_theta == 500000.0 and legacy.rope_scaling == {"rope_type": "llama3", "factor": 8.0}
    assert legacy.eos_token_ids == (5, 7) and legacy.torch_dtype == "bfloat16"
    assert (legacy.num_kv_heads, legacy.head_dim) == (4, 16)
    new = ModelConfig.from_dict({**base, "dtype": "float16",
                                 "rope_parameters": {"rope_type": "default", "rope_theta": 1e6}})
    assert new.rope_theta == 1e6 and new.rope_scaling is None and new.torch_dtype == "float16"
    with pytest.raises(UnsupportedModelError, match="yarn"):
        ModelConfig.from_dict({**base, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}})
    with pytest.raises(ValueError, match="unsupported dtype"):
        resolve_dtype("int8", new)


@pytest.mark.parametrize("rope_type", ["longrope", "su"])
def test_phi3_long_context_rope_is_refused(rope_type):
    factors = [1.0] * 8
    with pytest.raises(UnsupportedModelError, match=f"rope type '{rope_type}' is not supported"):
        ModelConfig.from_dict({"architectures": ["Phi3ForCausalLM"], "hidden_size": 64,
                               "intermediate_size": 128, "num_hidden_layers": 1, "num_attention_heads": 4,
                               "vocab_size": 10, "rope_scaling": {"type": rope_type, "short_factor": factors,
                                                                  "long_factor": factors}})


def test_phi3_fused_tensor_with_the_wrong_rows_is_an_error(tmp_path):
    model_dir = build_hf_model("phi3", tmp_path / "phi3")
    config = json.loads((model_dir / "config.json").read_text())
    config["num_key_value_heads"] = 4  # the checkpoint's qkv_proj stacks 2 KV heads' rows
    (model_dir / "config.json").write_text(json.dumps(config))
    with pytest.raises(WeightLoadError, match=r"qkv_proj\.weight: checkpoint has 128 rows, the config implies 192"):
        load_model(model_dir, torch.float32, "cpu")


def _stack_experts(weights: dict[str, torch.Tensor]) -> None:
    """Rewrite per-expert `mlp.experts.N.*_proj.weight` as transformers 5's stacked tensors."""
    for layer in sorted({n.split(".experts.")[0] for n in weights if ".experts." in n}):
        count = len({n for n in weights if n.startswith(f"{layer}.experts.") and n.endswith("down_proj.weight")})
        take = [{part: weights.pop(f"{layer}.experts.{e}.{part}_proj.weight") for part in ("gate", "up", "down")}
                for e in range(count)]
        weights[f"{layer}.experts.gate_up_proj"] = torch.stack([torch.cat((t["gate"], t["up"])) for t in take])
        weights[f"{layer}.experts.down_proj"] = torch.stack([t["down"] for t in take])


def test_stacked_expert_tensors_load_like_per_expert_ones(tmp_path):
    per_expert = build_hf_model("qwen3_moe", tmp_path / "per_expert")
    stacked = _copy_with_weights(per_expert, tmp_path / "stacked", _stack_experts)
    assert "model.layers.0.mlp.experts.gate_up_proj" in load_file(stacked / "model.safetensors")
    a, _ = load_model(per_expert, torch.float32, "cpu")
    b, _ = load_model(stacked, torch.float32, "cpu")
    for (name, pa), (_, pb) in zip(a.state_dict().items(), b.state_dict().items(), strict=True):
        assert torch.equal(pa, pb), name
    assert a.model.layers[0].mlp.experts.gate_up_proj.shape == (8, 2 * 32, 64)


def test_missing_expert_weight_is_named(tmp_path):
    model_dir = build_hf_model("mixtral", tmp_path / "mixtral")
    broken = _copy_with_weights(model_dir, tmp_path / "broken",
                                lambda w: w.pop("model.layers.1.block_sparse_moe.experts.5.w3.weight"))
    with pytest.raises(WeightLoadError, match=r"model\.layers\.1\.mlp\.experts\.gate_up_proj\[5\.up\]"):
        load_model(broken, torch.float32, "cpu")


def test_moe_config_parsing():
    base = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4, "num_attention_heads": 4,
            "vocab_size": 10, "num_experts_per_tok": 2}
    qwen = ModelConfig.from_dict({**base, "architectures": ["Qwen3MoeForCausalLM"], "num_experts": 16,
                                  "moe_intermediate_size": 32, "decoder_sparse_step": 2, "mlp_only_layers": [3]})
    assert (qwen.num_experts, qwen.moe_intermediate_size, qwen.norm_topk_prob, qwen.qk_norm) == (16, 32, False, True)
    assert [qwen.is_moe_layer(i) for i in range(4)] == [False, True, False, False]
    mixtral = ModelConfig.from_dict({**base, "architectures": ["MixtralForCausalLM"], "num_local_experts": 8})
    assert (mixtral.num_experts, mixtral.moe_intermediate_size, mixtral.norm_topk_prob) == (8, 128, True)
    assert all(mixtral.is_moe_layer(i) for i in range(4))
    dense = ModelConfig.from_dict({**base, "architectures": ["LlamaForCausalLM"]})
    assert dense.num_experts == 0 and not dense.is_moe_layer(0)
    with pytest.raises(UnsupportedModelError, match="clip_qkv"):
        ModelConfig.from_dict({**base, "architectures": ["OlmoeForCausalLM"], "num_experts": 8, "clip_qkv": 8.0})
    with pytest.raises(ValueError, match="LoRA is not supported on mixture-of-experts"):
        LoRAManager(torch.nn.Module(), mixtral, 1, 8, None, torch.float32, torch.device("cpu"))


def test_sliding_window_config_parsing():
    # Per-layer windows as HF applies them: every layer (Mistral), the layers from max_window_layers
    # on (Qwen2, only with use_sliding_window), or an explicit layer_types list.
    base = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4, "num_attention_heads": 4,
            "vocab_size": 10}
    mistral = ModelConfig.from_dict({**base, "architectures": ["MistralForCausalLM"], "sliding_window": 16})
    assert mistral.layer_windows == (16, 16, 16, 16) and mistral.layer_window(3) == 16
    assert mistral.kv_window == 16  # every layer windowed: the scheduler may free blocks before it
    qwen = {**base, "architectures": ["Qwen2ForCausalLM"], "sliding_window": 32, "max_window_layers": 3}
    assert ModelConfig.from_dict({**qwen, "use_sliding_window": True}).layer_windows == (None, None, None, 32)
    for off in ({**qwen, "use_sliding_window": False}, qwen):  # HF's Qwen2 default: off
        assert ModelConfig.from_dict(off).layer_windows == () and ModelConfig.from_dict(off).layer_window(0) is None
    typed = ModelConfig.from_dict({**base, "architectures": ["MistralForCausalLM"], "sliding_window": 8,
                                   "layer_types": ["sliding_attention", "full_attention"] * 2})
    assert typed.layer_windows == (8, None, 8, None) and typed.kv_window == 0  # a global layer reads all
    qwen_all = ModelConfig.from_dict({**qwen, "use_sliding_window": True, "max_window_layers": 0})
    assert qwen_all.layer_windows == (32,) * 4 and qwen_all.kv_window == 32
    assert ModelConfig.from_dict({**base, "architectures": ["MistralForCausalLM"],
                                  "sliding_window": None}).layer_windows == ()


def test_gemma_config_parsing():
    # Hub configs from before transformers 5 (no layer_types, rope_theta + rope_local_base_freq +
    # rope_scaling at the top level); transformers 5's own form is covered by tests/worker/test_hf_parity.py.
    base = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 6, "num_attention_heads": 4,
            "vocab_size": 10, "sliding_window": 8, "hidden_activation": "gelu_pytorch_tanh"}
    gemma2 = ModelConfig.from_dict({**base, "architectures": ["Gemma2ForCausalLM"], "hidden_act": "gelu_pytorch_tanh",
                                    "query_pre_attn_scalar": 144, "attn_logit_softcapping": 50.0,
                                    "final_logit_softcapping": 30.0})
    assert gemma2.layer_windows == (8, None) * 3 and gemma2.local_rope_theta is None
    assert gemma2.attention_multiplier == 144**-0.5 and gemma2.hidden_act == "gelu_pytorch_tanh"
    assert (gemma2.attn_logit_softcapping, gemma2.final_logit_softcapping) == (50.0, 30.0)
    gemma3 = ModelConfig.from_dict({**base, "architectures": ["Gemma3ForCausalLM"], "sliding_window_pattern": 3,
                                    "rope_theta": 1e6, "rope_local_base_freq": 1e4,
                                    "rope_scaling": {"rope_type": "linear", "factor": 8.0}})
    assert gemma3.layer_windows == (8, 8, None) * 2 and gemma3.qk_norm
    assert (gemma3.rope_theta, gemma3.rope_scaling, gemma3.local_rope_theta) == (
        1e6, {"rope_type": "linear", "factor": 8.0}, 1e4)
    assert gemma3.attention_multiplier == 256**-0.5  # HF's default query_pre_attn_scalar
    with pytest.raises(UnsupportedModelError, match="hidden_activation 'gelu'"):
        ModelConfig.from_dict({**base, "architectures": ["Gemma2ForCausalLM"], "hidden_activation": "gelu"})
