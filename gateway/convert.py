"""SamplingParams between the core dataclass (validation lives there) and the wire message.

The only gateway module that knows both `scheduler_svc.core.params` and the protobuf classes.
"""

from __future__ import annotations

from pagoda.v1 import common_pb2
from scheduler_svc.core.params import SamplingParams

_FINISH_REASONS = {
    common_pb2.FINISH_REASON_STOP: "stop",
    common_pb2.FINISH_REASON_LENGTH: "length",
    common_pb2.FINISH_REASON_ABORT: "abort",
    common_pb2.FINISH_REASON_ERROR: "error",
}
_FINISH_REASONS_PB = {name: code for code, name in _FINISH_REASONS.items()}


def sampling_to_pb(params: SamplingParams) -> common_pb2.SamplingParams:
    message = common_pb2.SamplingParams(
        n=params.n, temperature=params.temperature, top_p=params.top_p, top_k=params.top_k,
        min_p=params.min_p, min_tokens=params.min_tokens, stop_token_ids=params.stop_token_ids,
        ignore_eos=params.ignore_eos, presence_penalty=params.presence_penalty,
        frequency_penalty=params.frequency_penalty, repetition_penalty=params.repetition_penalty)
    # optional fields: absent on the wire means "the engine's default" (no seed, up to context...)
    if params.seed is not None:
        message.seed = params.seed
    if params.max_tokens is not None:
        message.max_tokens = params.max_tokens
    if params.logprobs is not None:
        message.logprobs = params.logprobs
    return message


def sampling_from_pb(message: common_pb2.SamplingParams) -> SamplingParams:
    """The public gRPC API's params; raises InvalidRequestError when out of range."""
    def optional(name: str, default):
        return getattr(message, name) if message.HasField(name) else default

    return SamplingParams(
        n=optional("n", 1), temperature=optional("temperature", 1.0), top_p=optional("top_p", 1.0),
        top_k=message.top_k, min_p=message.min_p, seed=optional("seed", None),
        max_tokens=optional("max_tokens", None), min_tokens=message.min_tokens,
        stop_token_ids=tuple(message.stop_token_ids), ignore_eos=message.ignore_eos,
        logprobs=optional("logprobs", None), presence_penalty=message.presence_penalty,
        frequency_penalty=message.frequency_penalty,
        repetition_penalty=optional("repetition_penalty", 1.0))


def finish_reason_name(code: int) -> str | None:
    """"stop" / "length" / "abort" / "error", or None while the sequence runs."""
    return _FINISH_REASONS.get(code)


def finish_reason_pb(name: str | None) -> int:
    return _FINISH_REASONS_PB.get(name, common_pb2.FINISH_REASON_UNSPECIFIED) if name else 0
