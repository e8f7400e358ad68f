"""The codec for `common.proto`: sampling params, logprobs and finish reasons.

One definition for every service: the gateway and the scheduler speak these messages on the Engine
API, the scheduler and the worker on the Steps stream. Pure functions over the core dataclasses.
"""

from __future__ import annotations

from pagoda.contract.lora import LoRARequest
from pagoda.contract.multimodal import MultiModalInput
from pagoda.contract.params import FinishReason, SamplingParams
from pagoda.contract.step import TokenLogprobs
from pagoda.contract.structured import StructuredOutputsParams
from pagoda.v1 import common_pb2

# proto3 `optional` fields: absent on the wire means the dataclass default (not zero), e.g. no seed,
# max_tokens up to the context length, temperature 1.0.
_OPTIONAL_SAMPLING = ("n", "temperature", "top_p", "seed", "max_tokens", "logprobs",
                      "repetition_penalty", "length_penalty", "prompt_logprobs")

_FINISH_TO_PB = {
    None: common_pb2.FINISH_REASON_UNSPECIFIED,
    FinishReason.STOP: common_pb2.FINISH_REASON_STOP,
    FinishReason.LENGTH: common_pb2.FINISH_REASON_LENGTH,
    FinishReason.ABORT: common_pb2.FINISH_REASON_ABORT,
    FinishReason.ERROR: common_pb2.FINISH_REASON_ERROR,
    FinishReason.MIGRATED: common_pb2.FINISH_REASON_MIGRATED,
}
_FINISH_FROM_PB = {code: reason for reason, code in _FINISH_TO_PB.items()}


def sampling_to_pb(params: SamplingParams) -> common_pb2.SamplingParams:
    pb = common_pb2.SamplingParams(
        n=params.n, temperature=params.temperature, top_p=params.top_p, top_k=params.top_k,
        min_p=params.min_p, min_tokens=params.min_tokens, stop_token_ids=params.stop_token_ids,
        ignore_eos=params.ignore_eos, presence_penalty=params.presence_penalty,
        frequency_penalty=params.frequency_penalty, repetition_penalty=params.repetition_penalty,
        logit_bias=params.logit_bias or {}, allowed_token_ids=params.allowed_token_ids or (),
        bad_words=[common_pb2.TokenIds(token_ids=word) for word in params.bad_words_token_ids],
        beam_width=params.beam_width, length_penalty=params.length_penalty, pooling=params.pooling)
    for name in ("seed", "max_tokens", "logprobs", "prompt_logprobs"):
        value = getattr(params, name)
        if value is not None:
            setattr(pb, name, value)
    if params.structured_outputs is not None:
        pb.structured_outputs.kind = params.structured_outputs.kind
        pb.structured_outputs.spec = params.structured_outputs.spec
    return pb


def sampling_from_pb(pb: common_pb2.SamplingParams) -> SamplingParams:
    """Validates (raises InvalidRequestError). An absent max_tokens means up to the context."""
    kwargs = {name: getattr(pb, name) for name in _OPTIONAL_SAMPLING if pb.HasField(name)}
    kwargs.setdefault("max_tokens", None)  # the dataclass default (16) is the offline API's
    return SamplingParams(
        **kwargs, top_k=pb.top_k, min_p=pb.min_p, min_tokens=pb.min_tokens,
        stop_token_ids=tuple(pb.stop_token_ids), ignore_eos=pb.ignore_eos,
        presence_penalty=pb.presence_penalty, frequency_penalty=pb.frequency_penalty,
        logit_bias=dict(pb.logit_bias) or None, allowed_token_ids=tuple(pb.allowed_token_ids) or None,
        bad_words_token_ids=tuple(tuple(word.token_ids) for word in pb.bad_words),
        beam_width=pb.beam_width, pooling=pb.pooling,
        structured_outputs=(StructuredOutputsParams.from_kind(pb.structured_outputs.kind,
                                                              pb.structured_outputs.spec)
                            if pb.HasField("structured_outputs") else None))


def logprobs_to_pb(lp: TokenLogprobs) -> common_pb2.TokenLogprobs:
    return common_pb2.TokenLogprobs(
        logprob=lp.logprob, top=[common_pb2.TopLogprob(token_id=t, logprob=p) for t, p in lp.top],
        rank=lp.rank)


def logprobs_from_pb(pb: common_pb2.TokenLogprobs) -> TokenLogprobs:
    return TokenLogprobs(logprob=pb.logprob, top=[(t.token_id, t.logprob) for t in pb.top],
                         rank=pb.rank if pb.HasField("rank") else None)


def finish_reason_to_pb(reason: FinishReason | str | None) -> int:
    """FinishReason or its name ("stop", "length", ...) -> the enum code; None -> UNSPECIFIED."""
    return _FINISH_TO_PB[FinishReason(reason) if reason else None]


def finish_reason_from_pb(code: int) -> FinishReason | None:
    """The enum code -> FinishReason (a str: "stop", ...), or None while the sequence runs."""
    return _FINISH_FROM_PB.get(code)


def lora_to_pb(lora: LoRARequest | None) -> common_pb2.LoRARequest | None:
    """None for the base model (the message field stays unset)."""
    if lora is None:
        return None
    return common_pb2.LoRARequest(lora_name=lora.lora_name, lora_int_id=lora.lora_int_id,
                                  lora_path=lora.lora_path)


def lora_from_pb(parent: object) -> LoRARequest | None:
    """The `lora` field of `parent` (a GenerateRequest or NewRequest); None when unset. Validates."""
    if not parent.HasField("lora"):  # type: ignore[attr-defined]
        return None
    pb = parent.lora  # type: ignore[attr-defined]
    return LoRARequest(pb.lora_name, pb.lora_int_id, pb.lora_path)


def mm_to_pb(item: MultiModalInput) -> common_pb2.MultiModalInput:
    return common_pb2.MultiModalInput(hash=item.hash, offset=item.offset, length=item.length,
                                      pixel_values=item.pixel_values, shape=item.shape)


def mm_list_from_pb(items) -> tuple[MultiModalInput, ...]:
    return tuple(MultiModalInput(pb.hash, pb.offset, pb.length, pb.pixel_values, tuple(pb.shape))
                 for pb in items)
