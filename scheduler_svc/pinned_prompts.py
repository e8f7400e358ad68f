"""`--pinned-prompts FILE`: the prompts the scheduler prefills at start-up and keeps cached.

The file is a JSON list; each entry is a list of token ids, a string (raw text, tokenized with
the model's tokenizer as a completions prompt is), or {"messages": [...]} (rendered with the
model's chat template, without the generation prompt: the prefix every conversation starting with
those messages shares). Text entries need the model's tokenizer files where the scheduler runs
(the model path the worker reports); token ids need nothing.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

Entry = list[int] | str | dict[str, Any]


class PinnedPromptsError(ValueError):
    """A bad --pinned-prompts file; the message names the file and the entry."""


def load_pinned_prompts(path: str) -> list[Entry]:
    try:
        entries = json.loads(Path(path).read_text())
    except (OSError, ValueError) as error:
        raise PinnedPromptsError(f"{path}: cannot read a JSON list: {error}") from error
    if not isinstance(entries, list):
        raise PinnedPromptsError(f"{path}: expected a JSON list of prompts")
    for i, entry in enumerate(entries):
        ok = (isinstance(entry, str) and entry) \
            or (isinstance(entry, list) and entry and all(isinstance(t, int) and t >= 0 for t in entry)) \
            or (isinstance(entry, dict) and isinstance(entry.get("messages"), list) and entry["messages"])
        if not ok:
            raise PinnedPromptsError(f"{path}: entry {i} is not a non-empty string, token-id list or "
                                     "{\"messages\": [...]}")
    return entries


def resolve_pinned_prompts(entries: list[Entry], model_path: str) -> list[list[int]]:
    """Token ids of every entry (the tokenizer is loaded only when an entry is text)."""
    tokenizer = None
    resolved = []
    for entry in entries:
        if isinstance(entry, list):
            resolved.append(list(entry))
            continue
        if tokenizer is None:
            from pagoda.runtime.model_files import load_tokenizer

            try:
                tokenizer = load_tokenizer(model_path)
            except (OSError, ValueError) as error:
                raise PinnedPromptsError(f"text pinned prompts need the model's tokenizer at {model_path!r} "
                                         f"({error}); give token-id lists instead") from error
        if isinstance(entry, str):
            resolved.append(list(tokenizer(entry)["input_ids"]))
        else:
            ids = tokenizer.apply_chat_template(entry["messages"], tokenize=True, add_generation_prompt=False)
            resolved.append(list(ids["input_ids"] if hasattr(ids, "keys") else ids))
    return resolved
