"""POST /v1/embeddings (OpenAI's shape, vLLM's extras): the inputs tokenized, then the pooling
path every front end shares (gateway/embedding.py: one prefill-only engine request per input, the
worker's pooled vector back)."""

from __future__ import annotations

import base64
from typing import Any, Literal

import numpy as np
from fastapi import Request
from pydantic import BaseModel, ConfigDict, field_validator

from gateway.batch_admission import admit_batch
from gateway.embedding import embed, pooling_requests
from gateway.openai.batch_prompts import split_prompts
from gateway.openai.middleware import admit
from gateway.openai.request_inputs import check_token_ids, new_request_id
from gateway.state import GatewayState


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
        prompts.append(ids)
    requests = pooling_requests(request_id, prompts, info.max_model_len)
    requests, leases = admit_batch(lambda r, max_model_len: admit(http, r, max_model_len), requests,
                                   info.max_model_len)
    vectors = await embed(pool.client, requests, leases)
    num_tokens = sum(len(ids) for ids in prompts)
    return {"object": "list", "model": pool.name,
            "data": [{"object": "embedding", "index": i, "embedding": _encode(v, body.encoding_format)}
                     for i, v in enumerate(vectors)],
            "usage": {"prompt_tokens": num_tokens, "total_tokens": num_tokens}}
