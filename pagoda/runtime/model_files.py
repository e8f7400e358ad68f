"""What `--model` names, for every process: an HF-format directory or a llama.cpp `.gguf` file.

Shared by the worker's loader, the gateway, the offline `LLM` and `pagoda.tools.default_model`, so every
reader of a model path accepts the same two formats.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any


def is_gguf_file(path: str | Path) -> bool:
    path = Path(path)
    return path.suffix == ".gguf" and path.is_file()


def load_tokenizer(model: str | Path, **kwargs: Any) -> Any:
    """The model's HF tokenizer; for a GGUF, transformers converts the file's tokenizer metadata
    (vocabulary, merges, special tokens, chat template)."""
    from transformers import AutoTokenizer  # slow import: only when text is involved

    if is_gguf_file(model):
        path = Path(model)
        try:
            return AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name, **kwargs)
        except ValueError as error:  # "GGUF model with architecture olmo2 is not supported yet."
            if "architecture" not in str(error):
                raise
        # AutoTokenizer parses the file's model config to pick a tokenizer class, which transformers
        # does for some GGUF architectures only (not OLMo 2, OLMoE or Granite); the tokenizer itself
        # converts from the metadata alone, into the same class AutoTokenizer gives a Llama GGUF.
        from transformers import PreTrainedTokenizerFast

        return PreTrainedTokenizerFast.from_pretrained(path.parent, gguf_file=path.name, **kwargs)
    return AutoTokenizer.from_pretrained(model, **kwargs)
