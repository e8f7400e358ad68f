"""POST /v1/embeddings for decoder models: each input a prefill-only engine request.

An input (a string, token ids, or a list of either, as /v1/completions' prompt) becomes one
GenerateRequest with SamplingParams.pooling and max_tokens 1: the scheduler runs it like any prompt
(chunked prefill; no prefix-cache hit: see worker_svc/pooling.py), the worker pools its final
hidden states (--pooling-type last|mean, L2-normalised unless --no-normalize-embeddings) and the
final response carries the vector in `embedding`. The one token sampled alongside is never read or
counted: usage is prompt tokens only, as OpenAI's. Several inputs run concurrently under one lease.
"""

from __future__ import annotations

import asyncio
import base64
from typing import Any, Literal

import numpy as np
from fastapi import Request
from pydantic import BaseModel, ConfigDict, field_validator

from gateway.generation import GenerationInput, to_engine_request
from gateway.openai.batch_prompts import admit_batch, split_prompts
from gateway.openai.middleware import admit
from gateway.openai.request_inputs import check_token_ids, new_request_id
from gateway.state import GatewayState
from pagoda.contract.errors import InvalidRequestError
from pagoda.contract.params import SamplingParams, check_context_length

_POOLING = SamplingParams(max_tokens=1, temperature=0.0, pooling=True)  # its token is discarded


class EmbeddingRequest(BaseModel):
    """OpenAI's EmbeddingCreateParams (+ vLLM's `add_special_tokens`, `truncate_prompt_tokens`
    refused); an unknown field is a 400 as on the generation routes."""

    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    input: str | list[int] | list[str] | list[list[int]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None
    user: str | None = None
    add_special_tokens: bool = True  # vLLM's: BOS in front of a text input

    @field_validator("dimensions")
    @classmethod
    def _no_dimensions(cls, dimensions: int | None) -> int | None:
        if dimensions is not None:  # a truncated decoder state is no Matryoshka embedding
            raise ValueError("not supported: the model's embeddings have its hidden size; "
                             "dimensions (Matryoshka truncation) is not served")
        return dimensions

    @field_validator("input")
    @classmethod
    def _not_empty(cls, value: Any) -> Any:
        if value == [] or value == "":
            raise ValueError("input must not be empty")
        return value


def _encode(vector: list[float], encoding_format: str) -> list[float] | str:
    if encoding_format == "base64":  # OpenAI's: the float32 array's little-endian bytes
        return base64.b64encode(np.asarray(vector, dtype="<f4").tobytes()).decode("ascii")
    return vector


async def create_embedding(body: EmbeddingRequest, http: Request, state: GatewayState) -> dict:
    pool = state.pool(body.model)
    tokenizer, info = pool.require_ready()
    request_id = new_request_id("embd")
    prompts = []
    for prompt in split_prompts(body.input):
        if isinstance(prompt, str):
            ids = tokenizer.encode(prompt, add_special_tokens=body.add_special_tokens)
        else:
            ids = list(prompt)
            check_token_ids(ids, info.vocab_size)
        if not ids:
            raise InvalidRequestError("an input must not be empty")
        check_context_length(info.max_model_len, len(ids), 1)
        prompts.append(ids)
    requests = [GenerationInput(request_id=f"{request_id}-{k}", prompt_token_ids=tuple(ids), sampling=_POOLING)
                for k, ids in enumerate(prompts)]
    requests, leases = admit_batch(lambda r, max_model_len: admit(http, r, max_model_len), requests,
                                   info.max_model_len)

    async def embed(request: GenerationInput, lease) -> list[float]:
        vector: list[float] = []
        async for response in pool.client.generate(to_engine_request(request)):
            if response.embedding:
                vector = list(response.embedding)
            if response.finished:
                break
        lease.record(len(request.prompt_token_ids))
        if not vector:
            raise InvalidRequestError("the engine returned no embedding for this model")
        return vector

    vectors = await asyncio.gather(*(embed(r, lease) for r, lease in zip(requests, leases, strict=True)))
    num_tokens = sum(len(ids) for ids in prompts)
    return {"object": "list", "model": pool.name,
            "data": [{"object": "embedding", "index": i, "embedding": _encode(v, body.encoding_format)}
                     for i, v in enumerate(vectors)],
            "usage": {"prompt_tokens": num_tokens, "total_tokens": num_tokens}}
