"""Generate the embedded default model: a small random-weight Llama plus a locally trained tokenizer.

    python -m pagoda.tools.tiny_model --out models/pagoda-tiny            # ~4M params, fp32 (default model)
    python -m pagoda.tools.tiny_model --out DIR --preset bench             # ~100M params, bf16 (benchmarks)

Real loading code, real architecture, meaningless text. The output is byte-identical on every run:
fixed seeds, a deterministic BPE trainer over `pagoda/tools/data/corpus.txt`, JSON with sorted keys.
The output of special tokens is damped in the LM head so greedy decoding does not stop at once.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

DATA_DIR = Path(__file__).parent / "data"
BOS, EOS, IM_START, IM_END = "<|begin_of_text|>", "<|end_of_text|>", "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = [BOS, EOS, IM_START, IM_END]  # ids 0..3, in this order
VOCAB_SIZE = 2048
SEED = 1234
INIT_STD = 0.02
QK_ELEMENT_STD = 1.6  # std of each q / k element for a unit-RMS input (see random_weights)
SPECIAL_ROW_STD = 0.002  # LM-head rows of special tokens: their logits stay near 0, never the argmax


@dataclass(frozen=True, slots=True)
class Preset:
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    max_position_embeddings: int
    dtype: str


PRESETS = {
    "tiny": Preset(256, 4, 4, 2, 64, 688, 2048, "float32"),
    "bench": Preset(768, 16, 12, 4, 64, 2048, 4096, "bfloat16"),  # ~104M parameters
}


def train_tokenizer() -> Tokenizer:
    """Byte-level BPE over the shipped corpus (the trainer is deterministic: checked by a test)."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB_SIZE, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    paragraphs = (DATA_DIR / "corpus.txt").read_text(encoding="utf-8").split("\n\n")
    tok.train_from_iterator(paragraphs, trainer)
    if tok.get_vocab_size() != VOCAB_SIZE:
        raise RuntimeError(f"tokenizer has {tok.get_vocab_size()} tokens, expected {VOCAB_SIZE}")
    # Plain encode() prepends BOS, as Llama 3 does; the chat template writes its own BOS.
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, 0)])
    return tok


def tokenizer_config(preset: Preset) -> dict:
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS,
        "eos_token": EOS,
        "pad_token": EOS,
        "add_bos_token": True,
        "clean_up_tokenization_spaces": False,
        "model_max_length": preset.max_position_embeddings,
        "chat_template": (DATA_DIR / "chat_template.jinja").read_text(encoding="utf-8"),
    }


def model_config(preset: Preset) -> dict:
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": preset.hidden_size,
        "intermediate_size": preset.intermediate_size,
        "num_hidden_layers": preset.num_layers,
        "num_attention_heads": preset.num_heads,
        "num_key_value_heads": preset.num_kv_heads,
        "head_dim": preset.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": preset.max_position_embeddings,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "rope_scaling": None,
        "vocab_size": VOCAB_SIZE,
        "tie_word_embeddings": False,
        "attention_bias": False,
        "mlp_bias": False,
        "initializer_range": INIT_STD,
        "bos_token_id": SPECIAL_TOKENS.index(BOS),
        "eos_token_id": SPECIAL_TOKENS.index(EOS),
        "pad_token_id": SPECIAL_TOKENS.index(EOS),
        "torch_dtype": preset.dtype,
        "use_cache": True,
    }


def generation_config() -> dict:
    # Both end-of-text and end-of-turn stop generation (plain completions and chat).
    return {"bos_token_id": SPECIAL_TOKENS.index(BOS),
            "eos_token_id": [SPECIAL_TOKENS.index(EOS), SPECIAL_TOKENS.index(IM_END)],
            "pad_token_id": SPECIAL_TOKENS.index(EOS)}


def random_weights(preset: Preset) -> dict[str, torch.Tensor]:
    """HF-named tensors: N(0, INIT_STD) matrices, unit norm weights, damped special-token logits."""
    gen = torch.Generator().manual_seed(SEED)
    dtype = getattr(torch, preset.dtype)
    p = preset

    def normal(*shape: int, std: float = INIT_STD) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen) * std).to(dtype)

    def ones(n: int) -> torch.Tensor:
        return torch.ones(n, dtype=dtype)

    q, kv = p.num_heads * p.head_dim, p.num_kv_heads * p.head_dim
    # Sharp attention: with INIT_STD everywhere, q.k scores have std ~0.1, attention is nearly
    # uniform and outputs barely depend on positions or on which cached block holds which token,
    # so a paging or RoPE bug could pass the parity tests. q and k elements of std ~1.6 give scores
    # of std ~1: a single misplaced position then changes ~20% of later greedy tokens.
    qk_std = QK_ELEMENT_STD / p.hidden_size**0.5
    weights = {"model.embed_tokens.weight": normal(VOCAB_SIZE, p.hidden_size)}
    for i in range(p.num_layers):
        pre = f"model.layers.{i}."
        weights.update({
            pre + "input_layernorm.weight": ones(p.hidden_size),
            pre + "self_attn.q_proj.weight": normal(q, p.hidden_size, std=qk_std),
            pre + "self_attn.k_proj.weight": normal(kv, p.hidden_size, std=qk_std),
            pre + "self_attn.v_proj.weight": normal(kv, p.hidden_size),
            pre + "self_attn.o_proj.weight": normal(p.hidden_size, q),
            pre + "post_attention_layernorm.weight": ones(p.hidden_size),
            pre + "mlp.gate_proj.weight": normal(p.intermediate_size, p.hidden_size),
            pre + "mlp.up_proj.weight": normal(p.intermediate_size, p.hidden_size),
            pre + "mlp.down_proj.weight": normal(p.hidden_size, p.intermediate_size),
        })
    weights["model.norm.weight"] = ones(p.hidden_size)
    lm_head = normal(VOCAB_SIZE, p.hidden_size)
    lm_head[: len(SPECIAL_TOKENS)] = normal(len(SPECIAL_TOKENS), p.hidden_size, std=SPECIAL_ROW_STD)
    weights["lm_head.weight"] = lm_head
    return weights


def _write_json(path: Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n", encoding="utf-8")


@contextlib.contextmanager
def staged_dir(out: Path) -> Iterator[Path]:
    """An empty sibling temp dir to build a model in, renamed to `out` (replacing it) when the
    block ends without error: an interrupted run never leaves a half model behind."""
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent, prefix=f".{out.name}-") as tmp:
        tmp_dir = Path(tmp) / "model"
        tmp_dir.mkdir()
        yield tmp_dir
        if out.exists():
            shutil.rmtree(out)
        tmp_dir.rename(out)


def write_model(out: Path, preset_name: str = "tiny", force: bool = False) -> bool:
    """Write the model into `out`; False (and nothing written) if it is already there."""
    out = Path(out)
    if (out / "config.json").is_file() and (out / "model.safetensors").is_file() and not force:
        return False
    preset = PRESETS[preset_name]
    with staged_dir(out) as tmp_dir:
        train_tokenizer().save(str(tmp_dir / "tokenizer.json"))
        _write_json(tmp_dir / "tokenizer_config.json", tokenizer_config(preset))
        _write_json(tmp_dir / "special_tokens_map.json",
                    {"bos_token": BOS, "eos_token": EOS, "pad_token": EOS})
        _write_json(tmp_dir / "config.json", model_config(preset))
        _write_json(tmp_dir / "generation_config.json", generation_config())
        # Only one metadata key: safetensors writes the metadata map in hash order.
        save_file(random_weights(preset), str(tmp_dir / "model.safetensors"), metadata={"format": "pt"})
        for file in tmp_dir.iterdir():
            file.chmod(0o644)
    return True


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, type=Path, help="output directory")
    parser.add_argument("--preset", choices=sorted(PRESETS), default="tiny")
    parser.add_argument("--force", action="store_true", help="overwrite an existing model")
    args = parser.parse_args(argv)
    if write_model(args.out, args.preset, args.force):
        print(f"wrote {args.preset} model to {args.out}")
    else:
        print(f"{args.out} already holds a model; use --force to regenerate")


if __name__ == "__main__":
    main()
