"""Embeddings for decoder models, whatever the front end (HTTP /v1/embeddings, the public gRPC
Embed): each input a prefill-only engine request.

An input becomes one GenerateRequest with SamplingParams.pooling and max_tokens 1: the scheduler
runs it like any prompt (chunked prefill; no prefix-cache hit: see worker_svc/pooling.py), the
worker pools its final hidden states (--pooling-type last|mean, L2-normalised unless
--no-normalize-embeddings) and the final response carries the vector in `embedding`. The one token
sampled alongside is never read or counted: usage is prompt tokens only, as OpenAI's. Several
inputs run concurrently under one lease (gateway/batch_admission.py).
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

from gateway.generation import GenerationInput, to_engine_request
from gateway.upstream.engine_client import EngineClient
from pagoda.contract.errors import InvalidRequestError
from pagoda.contract.params import POOLING, check_context_length


def pooling_requests(request_id: str, prompts: Sequence[Sequence[int]], max_model_len: int
                     ) -> list[GenerationInput]:
    """One engine request per tokenized input (`<request_id>-<k>`), each checked: not empty, and
    within the context (with the one token sampled alongside)."""
    for ids in prompts:
        if not ids:
            raise InvalidRequestError("an input must not be empty")
        check_context_length(max_model_len, len(ids), 1)
    return [GenerationInput(request_id=f"{request_id}-{k}", prompt_token_ids=tuple(ids), sampling=POOLING)
            for k, ids in enumerate(prompts)]


async def embed(client: EngineClient, requests: Sequence[GenerationInput], leases: Sequence[Any]
                ) -> list[list[float]]:
    """The vectors of admitted pooling requests, in order; each lease records its prompt tokens."""

    async def one(request: GenerationInput, lease: Any) -> list[float]:
        vector: list[float] = []
        async for response in client.generate(to_engine_request(request)):
            if response.embedding:
                vector = list(response.embedding)
            if response.finished:
                break
        lease.record(len(request.prompt_token_ids))
        if not vector:
            raise InvalidRequestError("the engine returned no embedding for this model")
        return vector

    return list(await asyncio.gather(*(one(r, lease) for r, lease in zip(requests, leases, strict=True))))
