"""An OpenAI request -> the GenerationInput generate() takes: its sampling params (validated by the
core SamplingParams), prompt ids checked against the context length and the vocabulary."""

from __future__ import annotations

import uuid

from gateway.generation import DEFAULT_SESSION_TTL_S, GenerationInput
from gateway.openai.protocol import _GenerationFields
from gateway.tokenizer import Tokenizer
from pagoda.contract.errors import InvalidRequestError
from pagoda.contract.params import (
    SamplingParams,
    check_context_length,
    check_vocab,
    with_bad_words_tokenized,
)

# Optional OpenAI/vLLM fields: None means "the core default", so they are passed only when set.
_OPTIONAL_SAMPLING = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


def new_request_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def build_sampling(request: _GenerationFields, max_tokens: int | None, logprobs: int | None,
                   tokenizer: Tokenizer, vocab_size: int,
                   prompt_logprobs: int | None = None) -> SamplingParams:
    """Validate through the core SamplingParams (one set of rules); token ids against the vocab."""
    optional = {name: getattr(request, name) for name in _OPTIONAL_SAMPLING
                if getattr(request, name) is not None}
    if request.beam_width:  # ranked by the raw logprobs, as vLLM's beam search: no temperature
        optional.pop("temperature", None)
        optional.update(beam_width=request.beam_width, length_penalty=request.length_penalty)
    sampling = SamplingParams(
        n=request.n, seed=request.seed, max_tokens=max_tokens, min_tokens=request.min_tokens,
        stop_token_ids=tuple(request.stop_token_ids or ()), ignore_eos=request.ignore_eos,
        logprobs=logprobs, presence_penalty=request.presence_penalty,
        frequency_penalty=request.frequency_penalty, logit_bias=request.logit_bias,
        allowed_token_ids=request.allowed_token_ids, bad_words=tuple(request.bad_words or ()),
        structured_outputs=request.structured_outputs_params(), prompt_logprobs=prompt_logprobs,
        **optional)
    sampling = with_bad_words_tokenized(
        sampling, lambda text: tokenizer.encode(text, add_special_tokens=False))
    check_vocab(sampling, vocab_size)
    return sampling


def build_generation_input(request: _GenerationFields, request_id: str, prompt_ids: list[int],
                           sampling: SamplingParams, max_model_len: int,
                           mm_inputs: tuple = ()) -> GenerationInput:
    """One prompt's GenerationInput; checks the context length."""
    if not prompt_ids:
        raise InvalidRequestError("the prompt must not be empty")
    check_context_length(max_model_len, len(prompt_ids), sampling.max_tokens)
    return GenerationInput(
        request_id=request_id, prompt_token_ids=tuple(prompt_ids), sampling=sampling,
        stop=request.stop_strings(), include_stop_str_in_output=request.include_stop_str_in_output,
        skip_special_tokens=request.skip_special_tokens, priority=request.priority,
        cache_salt=request.cache_salt or "", session_id=request.session_id or "",
        session_ttl_s=request.session_ttl or DEFAULT_SESSION_TTL_S, mm_inputs=mm_inputs)


def check_token_ids(token_ids: list[int], vocab_size: int) -> None:
    if vocab_size and any(not 0 <= t < vocab_size for t in token_ids):
        raise InvalidRequestError(f"token ids must be in [0, {vocab_size})")
