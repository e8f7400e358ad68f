"""The public gRPC API: pagoda.v1.Generation/Generate, the text-level twin of the OpenAI routes,
and Generation/Embed, /v1/embeddings' twin (the same pooling path, gateway/embedding.py)."""

from __future__ import annotations

import asyncio
import dataclasses
import uuid
from collections.abc import AsyncIterator

import grpc

from gateway.batch_admission import MAX_PROMPTS, admit_batch
from gateway.embedding import embed, pooling_requests
from gateway.errors import UnauthorizedError, to_client_error
from gateway.generation import (
    DEFAULT_SESSION_TTL_S,
    GenerationInput,
    GenerationStep,
    check_structured_outputs,
    generate,
    start_request_span,
)
from gateway.multimodal import MediaConfig
from gateway.state import GatewayState
from gateway.stop_strings import check_stop_strings
from gateway.tenancy.auth import grpc_bearer_token
from gateway.tenancy.leases import Lease
from gateway.tenancy.rate_limit import retry_after_header
from gateway.upstream.fallback import AdmitOnce, first_answer, prepend
from gateway.upstream.model_pools import ModelPool
from pagoda.contract.common_codec import finish_reason_to_pb, sampling_from_pb
from pagoda.contract.errors import InvalidRequestError
from pagoda.contract.image_inputs import ImageError, decode_image
from pagoda.contract.params import check_context_length, check_vocab
from pagoda.runtime.logging import get_logger
from pagoda.runtime.telemetry import context_from_grpc_metadata
from pagoda.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc

log = get_logger(__name__)


class GenerationServicer(gateway_pb2_grpc.GenerationServicer):
    def __init__(self, state: GatewayState) -> None:
        self._state = state

    async def Generate(self, request: gateway_pb2.GenerationRequest,
                       context: grpc.aio.ServicerContext) -> AsyncIterator[gateway_pb2.GenerationChunk]:
        # A client that goes away cancels this coroutine; leaving generate() cancels upstream.
        # The tenant's limits apply as over HTTP: the rate-limit headers go out as initial metadata
        # (trailing, with retry-after, on RESOURCE_EXHAUSTED), and the lease closes however it ends.
        lease = None
        try:
            lease = self._lease(context)
            tenant = lease.tenant
            route = self._state.route(request.model)
            admit_once = AdmitOnce(lambda g, max_model_len: (lease.admit(g, max_model_len), lease))
            operation = "chat" if request.WhichOneof("input") == "chat" else "text_completion"
            parent = context_from_grpc_metadata(context.invocation_metadata())

            async def start(pool: ModelPool, attempt: int):  # the request prepared for `pool`'s model
                generation, max_model_len = self._prepare(pool, request)
                if request.images:  # decoded and expanded off the event loop
                    generation = await asyncio.to_thread(
                        with_grpc_images, generation, pool, list(request.images), self._state.config.media)
                await check_structured_outputs(generation.sampling)
                generation, _ = admit_once(generation, max_model_len)
                if (headers := lease.headers()) and attempt == 0:
                    await context.send_initial_metadata(headers)
                span = start_request_span(operation, pool.name, parent, generation, tenant.name,
                                          route.fallback_from(pool))
                return generate(pool.client, pool.tokenizer, generation, span, lease, model=pool.name), generation

            answer = await first_answer(route, start)
            async for step in prepend(answer.first, answer.steps):
                for chunk in to_chunks(answer.context.request_id, step, answer.pool.name,
                                       self._state.config.enable_request_timings):
                    yield chunk
        except Exception as error:  # noqa: BLE001 - every failure leaves with a status code
            await _abort(context, error, lease, "grpc_generate_failed")
        finally:
            if lease is not None:
                lease.close()

    async def Embed(self, request: gateway_pb2.EmbedRequest,
                    context: grpc.aio.ServicerContext) -> gateway_pb2.EmbedResponse:
        """One vector per text, admitted under one lease as /v1/embeddings' inputs are."""
        lease = None
        try:
            lease = self._lease(context)
            pool = self._state.pool(request.model)
            tokenizer, info = pool.require_ready()
            if not request.texts or len(request.texts) > MAX_PROMPTS:
                raise InvalidRequestError(f"texts holds 1 to {MAX_PROMPTS} texts, got {len(request.texts)}")
            if not all(request.texts):
                raise InvalidRequestError("a text must not be empty")
            special = request.add_special_tokens if request.HasField("add_special_tokens") else True
            prompts = [tokenizer.encode(text, add_special_tokens=special) for text in request.texts]
            requests = pooling_requests(request.request_id or f"embd-{uuid.uuid4().hex}", prompts,
                                        info.max_model_len)
            requests, leases = admit_batch(lambda g, max_model_len: (lease.admit(g, max_model_len), lease),
                                           requests, info.max_model_len)
            if headers := lease.headers():
                await context.send_initial_metadata(headers)
            vectors = await embed(pool.client, requests, leases)
            num_tokens = sum(len(ids) for ids in prompts)
            return gateway_pb2.EmbedResponse(
                model=pool.name, embeddings=[gateway_pb2.EmbeddingVector(values=v) for v in vectors],
                usage=common_pb2.Usage(prompt_tokens=num_tokens))
        except Exception as error:  # noqa: BLE001 - every failure leaves with a status code
            await _abort(context, error, lease, "grpc_embed_failed")
        finally:
            if lease is not None:
                lease.close()

    def _lease(self, context: grpc.aio.ServicerContext) -> Lease:
        """The caller's tenant lease; the tenant's limits apply as over HTTP."""
        tenant = self._state.tenancy.authenticate(grpc_bearer_token(context.invocation_metadata()))
        if tenant is None:
            raise UnauthorizedError("a valid API key is required (metadata authorization: Bearer KEY)")
        return self._state.tenancy.lease(tenant)

    @staticmethod
    def _prepare(pool: ModelPool, request: gateway_pb2.GenerationRequest) -> tuple[GenerationInput, int]:
        """The request tokenized and validated for `pool`'s model, and that engine's max_model_len."""
        tokenizer, info = pool.require_ready()
        if request.WhichOneof("input") == "prompt":
            if not request.prompt:
                raise InvalidRequestError("the prompt must not be empty")
            prompt_ids = tokenizer.encode(request.prompt)
        elif request.WhichOneof("input") == "chat":
            messages = [{"role": m.role, "content": m.content} for m in request.chat.messages]
            prompt_ids = tokenizer.encode_chat(messages)
        else:
            raise InvalidRequestError("set either prompt or chat")
        if not prompt_ids:
            raise InvalidRequestError("the prompt must not be empty")
        sampling = sampling_from_pb(request.sampling)  # raises InvalidRequestError when out of range
        check_stop_strings(request.stop)
        check_context_length(info.max_model_len, len(prompt_ids), sampling.max_tokens)
        check_vocab(sampling, info.vocab_size)
        return GenerationInput(
            request_id=request.request_id or f"gen-{uuid.uuid4().hex}", prompt_token_ids=tuple(prompt_ids),
            sampling=sampling, stop=tuple(request.stop),
            include_stop_str_in_output=request.include_stop_str_in_output,
            skip_special_tokens=(request.skip_special_tokens if request.HasField("skip_special_tokens")
                                 else True),
            cache_salt=request.cache_salt, session_id=request.session_id,
            session_ttl_s=request.session_ttl_s or DEFAULT_SESSION_TTL_S), info.max_model_len


def with_grpc_images(generation: GenerationInput, pool: ModelPool, images: list[bytes],
                     media: MediaConfig) -> GenerationInput:
    """`generation` with its image placeholders expanded (InvalidRequestError naming images[i])."""
    tokenizer, info = pool.require_ready()
    if tokenizer.images is None:
        raise InvalidRequestError(f"model {pool.name!r} does not take images (not a vision-language model)")
    if len(images) > media.max_images_per_prompt:
        raise InvalidRequestError(f"{len(images)} images; at most {media.max_images_per_prompt} are allowed "
                                  "(--limit-mm-per-prompt)")
    decoded = []
    for i, data in enumerate(images):
        try:
            decoded.append(decode_image(data, media.limits))
        except ImageError as error:
            raise InvalidRequestError(f"images[{i}]: {error}") from None
    try:
        prompt_ids, mm_inputs = tokenizer.images.expand(list(generation.prompt_token_ids), decoded)
    except ImageError as error:
        raise InvalidRequestError(str(error)) from None
    check_context_length(info.max_model_len, len(prompt_ids), generation.sampling.max_tokens)
    return dataclasses.replace(generation, prompt_token_ids=tuple(prompt_ids), mm_inputs=mm_inputs)


async def _abort(context: grpc.aio.ServicerContext, error: Exception, lease: Lease | None, event: str) -> None:
    """Leave with the error's status code; the lease's rate-limit headers (and retry-after on
    RESOURCE_EXHAUSTED) as trailing metadata."""
    client_error = to_client_error(error)
    log.info(event, code=client_error.grpc_code.name, error=client_error.message)
    trailing = lease.headers() if lease is not None else []
    if client_error.retry_after_s is not None:
        trailing.append(("retry-after", retry_after_header(client_error.retry_after_s)))
    await context.abort(client_error.grpc_code, client_error.message, trailing_metadata=tuple(trailing))


def to_chunks(request_id: str, step: GenerationStep, model: str = "",
              with_timings: bool = False) -> list[gateway_pb2.GenerationChunk]:
    """One chunk per sequence with news, each naming the `model` that answered; the request's usage
    (and with --enable-request-timings its timings) rides on the step's last chunk."""
    chunks = [gateway_pb2.GenerationChunk(
        request_id=request_id, index=c.index, text=c.text, token_ids=c.token_ids, logprobs=c.logprobs,
        finish_reason=finish_reason_to_pb(c.finish_reason), model=model,
        prompt_logprobs=c.prompt_logprobs or ())
        for c in step.chunks if c.text or c.token_ids or c.finish_reason]
    if step.usage is not None:
        if not chunks:
            chunks.append(gateway_pb2.GenerationChunk(request_id=request_id, model=model))
        chunks[-1].usage.CopyFrom(common_pb2.Usage(
            prompt_tokens=step.usage.prompt_tokens, completion_tokens=step.usage.completion_tokens,
            cached_tokens=step.usage.cached_tokens))
        if with_timings and step.timings is not None:
            chunks[-1].timings.CopyFrom(step.timings)
    return chunks
