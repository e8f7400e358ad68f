"""Sampling parameters, finish reasons and the context-length rule: what a caller asks for.

Pure data shared by the gateway, the scheduler core, the worker's sampler and the offline API.
Field names follow vLLM's `SamplingParams` so users recognise them.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from enum import StrEnum

from pagoda.contract.errors import InvalidRequestError
from pagoda.contract.structured import StructuredOutputsParams


class FinishReason(StrEnum):
    STOP = "stop"  # EOS or one of stop_token_ids (stop strings are the gateway's)
    LENGTH = "length"  # max_tokens or max_model_len reached
    ABORT = "abort"  # cancelled by the caller
    ERROR = "error"  # failed: worker lost and not back in time, or an internal error
    MIGRATED = "migrated"  # moved to another replica (live migration); the gateway carries it on


_UINT32_MAX = 2**32 - 1
_INTEGER_RANGES = (  # (field, min, max): the ranges of their common.proto types
    ("top_k", -1, 2**31 - 1),
    ("seed", -(2**63), 2**63 - 1),
    ("max_tokens", 1, _UINT32_MAX),
    ("min_tokens", 0, _UINT32_MAX),
)


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How to pick tokens and when to stop. Defaults match vLLM's."""

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: off
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16  # None: up to max_model_len
    min_tokens: int = 0
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None  # None: none; 0: chosen token only; k: chosen + top k
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    # Token-level constraints, applied on the device before penalties (vLLM's logits processors).
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit, in [-100, 100]
    allowed_token_ids: tuple[int, ...] | None = None  # only these may be sampled
    bad_words: tuple[str, ...] = ()  # text; the offline API and the gateway tokenize them into:
    bad_words_token_ids: tuple[tuple[int, ...], ...] = ()  # what travels: never completed
    structured_outputs: StructuredOutputsParams | None = None  # JSON schema, regex, choice, grammar
    # Beam search inside the engine (scheduler_svc/core/beam_search.py): 0 = off; W >= 1 keeps the
    # W best sequences by cumulative raw logprob and returns the n best finished ones, ranked by
    # cumulative logprob / (output length ** length_penalty) as HF transformers does.
    beam_width: int = 0
    length_penalty: float = 1.0
    # Logprobs of the prompt's tokens (vLLM's): None: none; k: each prompt token's logprob, its rank
    # and the top k. The first token has none. Disables the prefix-cache hit for the request.
    prompt_logprobs: int | None = None
    # An embedding request (POST /v1/embeddings): the worker returns the prompt's pooled final hidden
    # state. Prefill only: it samples one token nobody reads, and gets no prefix-cache hit.
    pooling: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        if self.logit_bias is not None:
            try:
                bias = {int(t): float(b) for t, b in dict(self.logit_bias).items()}
            except (TypeError, ValueError):
                raise InvalidRequestError("logit_bias must map token ids to numbers") from None
            object.__setattr__(self, "logit_bias", bias or None)
        if self.allowed_token_ids is not None:
            object.__setattr__(self, "allowed_token_ids", tuple(self.allowed_token_ids))
        words = self.bad_words
        object.__setattr__(self, "bad_words", (words,) if isinstance(words, str) else tuple(words))
        object.__setattr__(self, "bad_words_token_ids",
                           tuple(tuple(word) for word in self.bad_words_token_ids))
        self.validate()

    def stop_tokens(self, eos_token_ids: Sequence[int]) -> frozenset[int]:
        """The tokens that end a sequence: stop_token_ids, plus the EOS ids unless ignore_eos."""
        return frozenset(self.stop_token_ids if self.ignore_eos else (*self.stop_token_ids, *eos_token_ids))

    @property
    def greedy(self) -> bool:
        # A beam's sampled token is replaced by the scheduler's choice: the argmax is the cheapest.
        return self.temperature < 1e-5 or self.top_k == 1 or self.beam_width > 0

    def validate(self, max_n: int = 64, max_logprobs: int = 20) -> None:
        def bad(msg: str) -> None:
            raise InvalidRequestError(msg)

        if not 1 <= self.n <= max_n:
            bad(f"n must be between 1 and {max_n}, got {self.n}")
        for name in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty",
                     "repetition_penalty"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not math.isfinite(value):
                bad(f"{name} must be a finite number, got {value!r}")
        if self.temperature < 0:
            bad(f"temperature must be non-negative, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            bad(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < -1:
            bad(f"top_k must be -1 (off), 0 (off) or positive, got {self.top_k}")
        if not 0 <= self.min_p <= 1:
            bad(f"min_p must be in [0, 1], got {self.min_p}")
        if not -2 <= self.presence_penalty <= 2:
            bad(f"presence_penalty must be in [-2, 2], got {self.presence_penalty}")
        if not -2 <= self.frequency_penalty <= 2:
            bad(f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}")
        if not 0 < self.repetition_penalty <= 2:
            bad(f"repetition_penalty must be in (0, 2], got {self.repetition_penalty}")
        if self.max_tokens is not None and self.max_tokens < 1:
            bad(f"max_tokens must be at least 1, got {self.max_tokens}")
        if self.min_tokens < 0:
            bad(f"min_tokens must be non-negative, got {self.min_tokens}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            bad(f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})")
        if self.logprobs is not None and not 0 <= self.logprobs <= max_logprobs:
            bad(f"logprobs must be between 0 and {max_logprobs}, got {self.logprobs}")
        if self.prompt_logprobs is not None and not 0 <= self.prompt_logprobs <= max_logprobs:
            bad(f"prompt_logprobs must be between 0 and {max_logprobs}, got {self.prompt_logprobs}")
        if any(not 0 <= t <= _UINT32_MAX for t in self.stop_token_ids):
            bad("stop_token_ids must be token ids (non-negative 32-bit integers)")
        self._validate_token_constraints(bad)
        if self.beam_width:
            self._validate_beam_search(bad)
        if self.pooling and (self.n != 1 or self.beam_width):  # (the gateway also sets max_tokens 1)
            bad("a pooling request is one sequence (n=1, no beam search)")
        # Integers must also fit their wire types (common.proto), or encoding fails mid-request.
        for name, low, high in _INTEGER_RANGES:
            value = getattr(self, name)
            if value is not None and not low <= value <= high:
                bad(f"{name} must be between {low} and {high}, got {value}")


    def _validate_beam_search(self, bad) -> None:
        """Beam search ranks by the raw model logprobs: settings that would change the
        distribution, or sample, have no meaning for it and are refused rather than ignored."""
        if not 1 <= self.beam_width <= 64:
            bad(f"beam_width must be between 1 and 64, got {self.beam_width}")
        if self.n > self.beam_width:
            bad(f"n ({self.n}) must not exceed the beam width ({self.beam_width})")
        if not math.isfinite(self.length_penalty):
            bad(f"length_penalty must be a finite number, got {self.length_penalty!r}")
        refused = [name for name, off in (
            ("logprobs", self.logprobs is None), ("prompt_logprobs", self.prompt_logprobs is None),
            ("min_tokens", self.min_tokens == 0),
            ("structured_outputs", self.structured_outputs is None),
            ("presence_penalty", self.presence_penalty == 0.0),
            ("frequency_penalty", self.frequency_penalty == 0.0),
            ("repetition_penalty", self.repetition_penalty == 1.0),
            ("logit_bias", not self.logit_bias), ("allowed_token_ids", self.allowed_token_ids is None),
            ("bad_words", not self.bad_words and not self.bad_words_token_ids),
            ("top_p", self.top_p == 1.0), ("top_k", self.top_k in (0, -1)), ("min_p", self.min_p == 0.0),
        ) if not off]
        if refused:
            bad(f"beam search ranks by the model's own logprobs and cannot be combined with "
                f"{', '.join(refused)}")

    def _validate_token_constraints(self, bad) -> None:
        for token, bias in (self.logit_bias or {}).items():
            if not 0 <= token <= _UINT32_MAX:
                bad(f"logit_bias keys must be token ids (non-negative), got {token}")
            if not math.isfinite(bias) or not -100 <= bias <= 100:
                bad(f"logit_bias values must be in [-100, 100], got {bias} for token {token}")
        if self.allowed_token_ids is not None:
            if not self.allowed_token_ids:
                bad("allowed_token_ids must not be empty")
            if any(not 0 <= t <= _UINT32_MAX for t in self.allowed_token_ids):
                bad("allowed_token_ids must be token ids (non-negative 32-bit integers)")
        for word in self.bad_words_token_ids:
            if not word or any(not 0 <= t <= _UINT32_MAX for t in word):
                bad("bad_words must tokenize to non-empty lists of token ids")
        if self.structured_outputs is not None and self.min_tokens:
            bad("min_tokens cannot be combined with structured outputs: the grammar decides where "
                "the output ends (EOS would be both required and forbidden)")


# An embedding request (every API's, and the offline LLM.embed): a prefill whose final hidden
# states the worker pools (worker_svc/pooling.py); the one token sampled alongside is never read.
POOLING = SamplingParams(max_tokens=1, temperature=0.0, pooling=True)


def num_beam_candidates(beam_width: int, num_stop_tokens: int) -> int:
    """Candidates a beam step ranks: HF's max(2, 1 + stop tokens) x width, enough that `width`
    of them continue even when every beam's best candidates are stop tokens. The worker returns
    this many top logprobs per beam; the scheduler picks from the union."""
    return max(2, 1 + num_stop_tokens) * beam_width


def check_vocab(params: SamplingParams, vocab_size: int) -> None:
    """400 when a token id the request names is outside the model's vocabulary."""
    if not vocab_size:
        return
    for name, ids in (("logit_bias", params.logit_bias or ()),
                      ("allowed_token_ids", params.allowed_token_ids or ())):
        outside = [t for t in ids if t >= vocab_size]
        if outside:
            raise InvalidRequestError(f"{name}: token id {outside[0]} is outside the vocabulary "
                                      f"[0, {vocab_size})")


def tokenize_bad_words(words: Sequence[str], encode: Callable[[str], list[int]]) -> tuple[tuple[int, ...], ...]:
    """vLLM's rule: each word as written and with a leading space (how it appears mid-text), each
    tokenized without special tokens; distinct non-empty token lists only."""
    out: dict[tuple[int, ...], None] = {}
    for word in words:
        for text in (word, " " + word.lstrip()):
            ids = tuple(encode(text))
            if ids:
                out[ids] = None
    return tuple(out)


def with_bad_words_tokenized(params: SamplingParams, encode: Callable[[str], list[int]]) -> SamplingParams:
    """params with `bad_words` (text) turned into bad_words_token_ids, what travels and is applied."""
    if not params.bad_words:
        return params
    ids = params.bad_words_token_ids + tokenize_bad_words(params.bad_words, encode)
    return replace(params, bad_words=(), bad_words_token_ids=ids)


def check_context_length(max_model_len: int, num_prompt_tokens: int, max_tokens: int | None) -> None:
    """Raise vLLM's message when the request cannot fit the context (max_tokens None: up to it)."""
    if max_tokens is None:
        if num_prompt_tokens >= max_model_len:
            raise InvalidRequestError(
                f"This model's maximum context length is {max_model_len} tokens. However, your "
                f"messages resulted in {num_prompt_tokens} tokens. Please reduce the length of the "
                "messages.")
        return
    if num_prompt_tokens + max_tokens > max_model_len:
        raise InvalidRequestError(
            f"This model's maximum context length is {max_model_len} tokens. However, you requested "
            f"{num_prompt_tokens + max_tokens} tokens ({num_prompt_tokens} in the messages, "
            f"{max_tokens} in the completion). Please reduce the length of the messages or completion.")
