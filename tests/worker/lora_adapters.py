"""PEFT LoRA adapters with random weights on a local HF model, and HF + PEFT greedy references.

Shared by the LoRA parity tests (tests/worker) and the end-to-end ones (tests/e2e).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch


@dataclass(frozen=True)
class AdapterSpec:
    name: str
    rank: int
    targets: tuple[str, ...]
    lora_alpha: float = 16.0
    use_rslora: bool = False
    seed: int = 0


ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")
# Ranks 8 and 16, attention only / MLP only / all / a subset, alpha / r and rsLoRA scaling.
SPECS = (
    AdapterSpec("attn-r8", 8, ATTENTION, seed=1),
    AdapterSpec("mlp-r16", 16, MLP, lora_alpha=32.0, seed=2),
    AdapterSpec("all-r8", 8, ATTENTION + MLP, lora_alpha=8.0, seed=3),
    AdapterSpec("qv-down-r16", 16, ("q_proj", "v_proj", "down_proj"), use_rslora=True, seed=4),
)


def make_adapter(base_dir: str | Path, out_dir: Path, spec: AdapterSpec) -> Path:
    """Save a PEFT adapter whose A and B are both random (init_lora_weights=False: B is not zero)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(spec.seed)
    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    config = LoraConfig(r=spec.rank, lora_alpha=spec.lora_alpha, target_modules=list(spec.targets),
                        use_rslora=spec.use_rslora, init_lora_weights=False, lora_dropout=0.0)
    model = get_peft_model(base, config)
    with torch.no_grad():  # larger than PEFT's init, so every adapter changes the greedy output
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.mul_(3.0)
    model.save_pretrained(out_dir)
    return out_dir


def make_adapters(base_dir: str | Path, out_root: Path, specs=SPECS) -> dict[str, Path]:
    return {spec.name: make_adapter(base_dir, out_root / spec.name, spec) for spec in specs}


class PeftReference:
    """HF transformers + PEFT greedy generation, fp32, one prompt at a time (exact, no padding)."""

    def __init__(self, base_dir: str | Path, adapters: dict[str, Path]) -> None:
        from peft import PeftModel
        from transformers import AutoModelForCausalLM, GenerationConfig

        base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32).eval()
        self.generation_config = GenerationConfig.from_model_config(base.config)
        names = list(adapters)
        self.model = PeftModel.from_pretrained(base, str(adapters[names[0]]), adapter_name=names[0]).eval()
        for name in names[1:]:
            self.model.load_adapter(str(adapters[name]), adapter_name=name)

    @torch.inference_mode()
    def generate(self, prompt: list[int], max_new_tokens: int, adapter: str | None,
                 eos: list[int]) -> list[int]:
        ids = torch.tensor([prompt])
        kwargs = dict(attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                      do_sample=False, eos_token_id=eos, pad_token_id=eos[0] if eos else 0,
                      temperature=None, top_p=None, top_k=None)
        if adapter is None:
            with self.model.disable_adapter():
                out = self.model.generate(input_ids=ids, **kwargs)
        else:
            self.model.set_adapter(adapter)
            out = self.model.generate(input_ids=ids, **kwargs)
        return out[0, len(prompt):].tolist()
