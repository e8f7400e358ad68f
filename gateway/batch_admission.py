"""Several prompts of one call (a list of completion prompts, of embedding inputs over HTTP or
gRPC) admitted under one tenant lease: one reservation for all, each prompt's stream recording its
own usage, the lease seeing the sum."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

from gateway.generation import GenerationInput

MAX_PROMPTS = 256  # prompts (or embedding inputs) in one call; each is an upstream request

def admit_batch(admit: Callable[[GenerationInput, int], tuple[GenerationInput, Any]],
                requests: Sequence[GenerationInput], max_model_len: int
                ) -> tuple[list[GenerationInput], list[Any]]:
    """Admit every prompt under one lease: one combined reservation of the prompts' tokens plus
    n × max_tokens each. Returns the requests (with the lease's cache salt) and one lease view per
    request (each records its own usage; the lease sees the sum)."""
    if len(requests) == 1:
        request, lease = admit(requests[0], max_model_len)
        return [request], [lease]
    first = requests[0]
    sampling = first.sampling
    max_new = sum(sampling.max_tokens if sampling.max_tokens is not None
                  else max(0, max_model_len - len(r.prompt_token_ids)) for r in requests)
    combined = dataclasses.replace(
        first, prompt_token_ids=tuple(t for r in requests for t in r.prompt_token_ids),
        sampling=dataclasses.replace(sampling, max_tokens=max(1, max_new)))
    salted, lease = admit(combined, max_model_len)
    shared = _SharedUsage(lease, len(requests))
    return ([dataclasses.replace(r, cache_salt=salted.cache_salt, tenant=salted.tenant, kv_share=salted.kv_share)
             for r in requests],
            [shared.view(k) for k in range(len(requests))])


class _SharedUsage:
    """The lease's `record` as the sum of what each prompt's stream recorded."""

    def __init__(self, lease: Any, num_streams: int) -> None:
        self.lease = lease
        self.used = [0] * num_streams

    def view(self, index: int) -> _UsageView:
        return _UsageView(self, index)

    def record(self, index: int, used_tokens: int) -> None:
        self.used[index] = used_tokens
        self.lease.record(sum(self.used))


@dataclasses.dataclass(slots=True)
class _UsageView:
    shared: _SharedUsage
    index: int

    @property
    def tenant(self) -> Any:
        return self.shared.lease.tenant

    def record(self, used_tokens: int) -> None:
        self.shared.record(self.index, used_tokens)
