"""The real default model, SmolLM2-135M-Instruct, and HF transformers' greedy answers on it: session
fixtures shared by the worker's parity tests and the end-to-end ones (tests/conftest.py registers
them once). Skipped, with the reason, when the wheel cannot be fetched (no network and no cache).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from pagoda.runtime.model_files import load_tokenizer
from pagoda.tools import default_model

REPO = Path(__file__).resolve().parents[1]
MAX_TOKENS = 24
PROMPTS = [
    "What is the capital of France?",
    "Name three primary colors.",
    "Write a haiku about the sea.",
    "What is 12 times 7?",
    "Give me one tip for learning Python.",
    "Who wrote Romeo and Juliet?",
    "Explain photosynthesis in one sentence.",
    "Translate 'good morning' into Spanish.",
]


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    offline = os.environ.get("PAGODA_OFFLINE") == "1"
    try:
        return default_model.fetch_gguf(REPO / default_model.DEFAULT_CACHE, offline=offline)
    except default_model.FetchError as error:
        pytest.skip(f"SmolLM2 GGUF unavailable (run `make model` with network access): {error}")


@pytest.fixture(scope="session")
def smollm2_dir(smollm2_gguf) -> Path:
    out = REPO / default_model.DEFAULT_OUT  # what `make model` wrote; converted here otherwise
    if not default_model.is_complete(out):
        default_model.write_hf_dir(smollm2_gguf, out)
    return out


@pytest.fixture(scope="session")
def gguf_tokenizer(smollm2_gguf):
    return load_tokenizer(smollm2_gguf)


@pytest.fixture(scope="session")
def chats(gguf_tokenizer) -> list[list[int]]:
    ids = [gguf_tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True,
                                              tokenize=True) for p in PROMPTS]
    return [list(i["input_ids"] if hasattr(i, "keys") else i) for i in ids]


@pytest.fixture(scope="session")
def hf_model(smollm2_gguf):
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(
        smollm2_gguf.parent, gguf_file=smollm2_gguf.name, dtype=torch.float32)
    return model.eval()


@pytest.fixture(scope="session")
def hf_greedy(hf_model, chats) -> list[list[int]]:
    """HF's greedy continuation of each chat, one at a time (no padding), EOS included."""
    outs = []
    with torch.no_grad():
        for ids in chats:
            out = hf_model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                    max_new_tokens=MAX_TOKENS, do_sample=False, pad_token_id=2)
            outs.append(out[0, len(ids):].tolist())
    return outs
