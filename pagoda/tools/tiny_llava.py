"""Generate a small random-weight LLaVA-1.5-style model: CLIP vision tower + MLP projector + Llama LM.

    python -m pagoda.tools.tiny_llava --out models/pagoda-tiny-llava
    python -m pagoda.tools.tiny_llava --out DIR --variant siglip-qwen2   # SigLIP tower, Qwen2 LM

Real HF classes (LlavaConfig, LlavaForConditionalGeneration, CLIPImageProcessor, LlavaProcessor)
saved with save_pretrained, so the directory is exactly what a real llava-hf checkpoint looks like
(config.json with text_config / vision_config, preprocessor_config.json, processor_config.json, a
chat template that renders image parts as `<image>`). The tokenizer is pagoda-tiny's BPE plus
`<image>`. Small dims: 56x56 images in 14x14 patches -> 16 image tokens per image (CLS dropped,
vision_feature_select_strategy "default", as LLaVA-1.5). The siglip-qwen2 variant: a SigLIP tower
(no CLS; strategy "full", 16 tokens too) under a Qwen2 language model (q/k/v biases).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from pagoda.tools.tiny_model import (
    BOS,
    EOS,
    IM_END,
    PRESETS,
    QK_ELEMENT_STD,
    SPECIAL_TOKENS,
    VOCAB_SIZE,
    staged_dir,
    tokenizer_config,
    train_tokenizer,
)

SEED = 4321
IMAGE_TOKEN = "<image>"
IMAGE_TOKEN_ID = VOCAB_SIZE  # the first id after the BPE vocabulary
TEXT_VOCAB = VOCAB_SIZE + 8  # room for <image>, padded to a multiple of 8
IMAGE_SIZE, PATCH_SIZE = 56, 14
NUM_IMAGE_TOKENS = (IMAGE_SIZE // PATCH_SIZE) ** 2  # CLS dropped ("default" strategy)

# Content parts: an image part renders as the placeholder the processor expands; string content too.
CHAT_TEMPLATE = (
    "{{- bos_token -}}"
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' -}}"
    "{%- if message['content'] is string -%}{{- message['content'] -}}"
    "{%- else -%}{%- for part in message['content'] -%}"
    "{%- if part['type'] == 'image' -%}{{- '<image>' -}}"
    "{%- elif part['type'] == 'text' -%}{{- part['text'] -}}{%- endif -%}"
    "{%- endfor -%}{%- endif -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)


VARIANTS = ("clip-llama", "siglip-qwen2")


def build_model(variant: str = "clip-llama"):
    from transformers import (
        CLIPVisionConfig,
        LlamaConfig,
        LlavaConfig,
        LlavaForConditionalGeneration,
        Qwen2Config,
        SiglipVisionConfig,
    )

    siglip = variant == "siglip-qwen2"
    text_config = Qwen2Config if siglip else LlamaConfig
    text = text_config(vocab_size=TEXT_VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=1024,
                       rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False,
                       bos_token_id=0, eos_token_id=[1, SPECIAL_TOKENS.index(IM_END)], pad_token_id=1)
    vision_config = SiglipVisionConfig if siglip else CLIPVisionConfig
    vision = vision_config(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                           image_size=IMAGE_SIZE, patch_size=PATCH_SIZE)
    config = LlavaConfig(vision_config=vision, text_config=text, image_token_index=IMAGE_TOKEN_ID,
                         projector_hidden_act="gelu", vision_feature_layer=-2,
                         vision_feature_select_strategy="full" if siglip else "default",
                         image_seq_length=NUM_IMAGE_TOKENS, tie_word_embeddings=False)
    torch.manual_seed(SEED)
    model = LlavaForConditionalGeneration(config).eval()
    gen = torch.Generator().manual_seed(SEED)
    with torch.no_grad():
        lm = model.model.language_model
        # Sharp attention (as pagoda-tiny): a misplaced position or image row changes later tokens.
        for layer in lm.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj):
                proj.weight.copy_(torch.randn(proj.weight.shape, generator=gen) * QK_ELEMENT_STD / text.hidden_size**0.5)
        # Special tokens and <image> never win greedy decoding (a sampled <image> would be text).
        head = model.lm_head.weight
        head[: len(SPECIAL_TOKENS)] *= 0.1
        head[VOCAB_SIZE:] *= 0.0
        # Image embeddings on the scale of token embeddings, so the image visibly steers the output.
        model.model.multi_modal_projector.linear_2.weight.mul_(4.0)
    model.generation_config.eos_token_id = [1, SPECIAL_TOKENS.index(IM_END)]
    model.generation_config.bos_token_id = 0
    model.generation_config.pad_token_id = 1
    return model


def build_processor(variant: str = "clip-llama"):
    from transformers import CLIPImageProcessor, LlavaProcessor, PreTrainedTokenizerFast, SiglipImageProcessor

    cfg = tokenizer_config(PRESETS["tiny"])
    tok = PreTrainedTokenizerFast(tokenizer_object=train_tokenizer(), bos_token=BOS, eos_token=EOS,
                                  pad_token=EOS, clean_up_tokenization_spaces=False,
                                  model_max_length=1024)
    tok.add_special_tokens({"additional_special_tokens": [IMAGE_TOKEN]})
    assert tok.convert_tokens_to_ids(IMAGE_TOKEN) == IMAGE_TOKEN_ID, cfg
    tok.chat_template = CHAT_TEMPLATE
    if variant == "siglip-qwen2":  # SigLIP resizes to a square, no crop, and has no CLS token
        images = SiglipImageProcessor(size={"height": IMAGE_SIZE, "width": IMAGE_SIZE})
        strategy, extra = "full", 0
    else:
        images = CLIPImageProcessor(size={"shortest_edge": IMAGE_SIZE},
                                    crop_size={"height": IMAGE_SIZE, "width": IMAGE_SIZE})
        strategy, extra = "default", 1
    return LlavaProcessor(image_processor=images, tokenizer=tok, patch_size=PATCH_SIZE,
                          vision_feature_select_strategy=strategy, num_additional_image_tokens=extra,
                          image_token=IMAGE_TOKEN, chat_template=CHAT_TEMPLATE)


def write_model(out: Path, force: bool = False, variant: str = "clip-llama") -> bool:
    """Write the model into `out`; False (and nothing written) if it is already there."""
    out = Path(out)
    if (out / "config.json").is_file() and (out / "model.safetensors").is_file() and not force:
        return False
    with staged_dir(out) as tmp_dir:
        build_model(variant).save_pretrained(tmp_dir)
        processor = build_processor(variant)
        processor.save_pretrained(tmp_dir)
        processor.tokenizer.save_pretrained(tmp_dir)  # tokenizer_config.json holds the template too
    return True


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, type=Path, help="output directory")
    parser.add_argument("--force", action="store_true", help="overwrite an existing model")
    parser.add_argument("--variant", choices=VARIANTS, default="clip-llama")
    args = parser.parse_args(argv)
    print(f"wrote tiny LLaVA to {args.out}" if write_model(args.out, args.force, args.variant)
          else f"{args.out} already holds a model; use --force to regenerate")


if __name__ == "__main__":
    main()
