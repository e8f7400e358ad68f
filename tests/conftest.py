"""Fixtures shared across test packages, registered once per session here (a fixture imported into
several modules would be one instance per module)."""

from tests.smollm2_fixtures import (  # noqa: F401 - pytest finds fixtures by name
    chats,
    gguf_tokenizer,
    hf_greedy,
    hf_model,
    smollm2_dir,
    smollm2_gguf,
)
