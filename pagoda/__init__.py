"""Pagoda: a vLLM-like inference server. `from pagoda import LLM, SamplingParams` for offline use.

Exports are lazy (module `__getattr__`), so `import pagoda` stays cheap and never imports torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pagoda.contract.lora import LoRARequest
    from pagoda.contract.params import SamplingParams
    from pagoda.contract.structured import StructuredOutputsParams
    from pagoda.entrypoints.beam_search import BeamSearchParams
    from pagoda.entrypoints.llm import LLM, CompletionOutput, EmbeddingRequestOutput, RequestOutput

_EXPORTS = {
    "LLM": "pagoda.entrypoints.llm",
    "RequestOutput": "pagoda.entrypoints.llm",
    "CompletionOutput": "pagoda.entrypoints.llm",
    "EmbeddingRequestOutput": "pagoda.entrypoints.llm",
    "SamplingParams": "pagoda.contract.params",
    "LoRARequest": "pagoda.contract.lora",
    "StructuredOutputsParams": "pagoda.contract.structured",
    "BeamSearchParams": "pagoda.entrypoints.beam_search",
}

__all__ = ["BeamSearchParams", "CompletionOutput", "EmbeddingRequestOutput", "LLM", "LoRARequest", "RequestOutput", "SamplingParams",
           "StructuredOutputsParams"]


def __getattr__(name: str) -> Any:
    module_name = _EXPORTS.get(name)
    if module_name is None:
        raise AttributeError(f"module 'pagoda' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(module_name), name)
    globals()[name] = value  # later lookups skip __getattr__
    return value
