"""Model implementations, keyed by the HF `architectures` name they serve."""

from __future__ import annotations

from torch import nn

from worker_svc.model_loader.errors import UnsupportedModelError
from worker_svc.model_loader.model_config import SUPPORTED_ARCHITECTURES, ModelConfig


def model_class(cfg: ModelConfig) -> type[nn.Module]:
    from worker_svc.models.gemma import GemmaForCausalLM
    from worker_svc.models.llama import LlamaForCausalLM
    from worker_svc.models.moe import MoEForCausalLM, OlmoeForCausalLM
    from worker_svc.models.olmo2 import Olmo2ForCausalLM

    if cfg.architecture == "Olmo2ForCausalLM":
        return Olmo2ForCausalLM
    if cfg.architecture in ("Gemma2ForCausalLM", "Gemma3ForCausalLM"):
        return GemmaForCausalLM
    if cfg.architecture == "OlmoeForCausalLM":
        return OlmoeForCausalLM
    if cfg.architecture in ("MixtralForCausalLM", "Qwen3MoeForCausalLM"):
        return MoEForCausalLM
    # One implementation serves the rest of the Llama family; flags in ModelConfig select the variants.
    if cfg.architecture in SUPPORTED_ARCHITECTURES:
        return LlamaForCausalLM
    raise UnsupportedModelError(
        f"unsupported architecture {cfg.architecture}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
