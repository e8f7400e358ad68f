"""The gateway's tokenizer: prompts to ids, chat templates, and incremental detokenization.

The gateway is the only service that sees text; the scheduler and workers see token ids only.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from pagoda.contract.image_inputs import ImageProcessor
from pagoda.runtime.model_files import load_tokenizer

# Prompt tokens decoded in front of the first output token: enough for a tokenizer that decides
# spaces from the previous token (SentencePiece "▁"), few enough to keep each decode cheap.
_CONTEXT_TOKENS = 6
_REPLACEMENT_CHAR = "\ufffd"  # what decode() yields for an incomplete UTF-8 sequence


class Tokenizer:
    """A thin wrapper over a Hugging Face tokenizer: a local model directory's, or a GGUF file's."""

    def __init__(self, hf_tokenizer: Any, images: ImageProcessor | None = None) -> None:
        self.hf = hf_tokenizer
        self.images = images  # a vision-language model's image processor (docs/vision.md); None: text only

    @classmethod
    def load(cls, path: str) -> Tokenizer:
        return cls(load_tokenizer(path), ImageProcessor.load(path))

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self.hf(text, add_special_tokens=add_special_tokens)["input_ids"])

    def render_chat(self, messages: Sequence[dict[str, Any]], add_generation_prompt: bool = True,
                    **template_kwargs: Any) -> str:
        """The chat template as text; tokenize it with add_special_tokens=False (it holds BOS)."""
        if not getattr(self.hf, "chat_template", None):
            raise ValueError("the model's tokenizer has no chat template; use /v1/completions")
        return self.hf.apply_chat_template(list(messages), add_generation_prompt=add_generation_prompt,
                                           tokenize=False, **template_kwargs)

    def encode_chat(self, messages: Sequence[dict[str, Any]], add_generation_prompt: bool = True,
                    **template_kwargs: Any) -> list[int]:
        text = self.render_chat(messages, add_generation_prompt, **template_kwargs)
        return self.encode(text, add_special_tokens=False)

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.hf.decode(list(token_ids), skip_special_tokens=skip_special_tokens)

    def token_text(self, token_id: int) -> str:
        """One token as text, for logprobs (may be U+FFFD for a partial UTF-8 byte)."""
        return self.hf.decode([token_id], skip_special_tokens=False)

    def token_texts(self, token_ids: Sequence[int]) -> list[str]:
        return [self.token_text(t) for t in token_ids]

    def logprob_names(self, as_token_ids: bool) -> Tokenizer:
        """What names the tokens in logprobs: this tokenizer, or (vLLM's return_tokens_as_token_ids)
        one that names each "token_id:N", so a client can tell apart tokens whose text is the same
        or not valid UTF-8 on its own."""
        return _TokenIdNames(self.hf) if as_token_ids else self


class _TokenIdNames(Tokenizer):
    def token_text(self, token_id: int) -> str:
        return f"token_id:{token_id}"


class IncrementalDetokenizer:
    """Turns one sequence's token ids into text deltas, never emitting half a UTF-8 character.

    The prefix/read-offset algorithm (TGI, vLLM): decode ids[prefix:] and ids[prefix:read];
    the text between them is new once it does not end in U+FFFD. Invariant: the concatenated
    deltas plus `flush()` equal decode(context + ids) minus decode(context).
    """

    def __init__(self, tokenizer: Tokenizer, prompt_token_ids: Sequence[int],
                 skip_special_tokens: bool = True) -> None:
        self._tokenizer = tokenizer
        self._skip_special = skip_special_tokens
        self._ids: list[int] = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        self._prefix_offset = 0  # ids[prefix:read] is text already emitted (or context)
        self._read_offset = len(self._ids)

    def _decode(self, start: int, end: int | None = None) -> str:
        return self._tokenizer.decode(self._ids[start:end], skip_special_tokens=self._skip_special)

    def step(self, token_id: int) -> str:
        """Append one token; return the text it completes ("" while a character is partial)."""
        self._ids.append(token_id)
        prefix_text = self._decode(self._prefix_offset, self._read_offset)
        new_text = self._decode(self._prefix_offset)
        if len(new_text) <= len(prefix_text) or new_text.endswith(_REPLACEMENT_CHAR):
            return ""
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        return new_text[len(prefix_text):]

    def flush(self) -> str:
        """At the end: whatever is still held (a truncated character decodes as U+FFFD)."""
        prefix_text = self._decode(self._prefix_offset, self._read_offset)
        new_text = self._decode(self._prefix_offset)
        self._prefix_offset = self._read_offset = len(self._ids)
        return new_text[len(prefix_text):]
