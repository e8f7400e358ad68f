"""Mid-stream failover (gateway/upstream/replica_set.py) over in-process fake Engines: a replica
that fails UNAVAILABLE after streaming some tokens has the request carried on by another, and the
caller sees exactly the stream an undisturbed run gives; request errors and streams that cannot
be carried on (n > 1) still end with their error, and so does a request past its failover budget.

The fake engine samples like the real seeded sampler: each token is a function of (seed, output
position, the tokens before it), the output position counting `num_prior_output_tokens`. A
continuation that lost its earlier output's count, its seed or its history streams other tokens.
"""

from __future__ import annotations

import contextlib
import hashlib
from dataclasses import dataclass

import grpc
import httpx
import openai
import pytest

from gateway import metrics
from gateway.config import GatewayConfig
from gateway.errors import UpstreamError
from gateway.openai.api_server import create_app
from gateway.state import GatewayState
from gateway.upstream.replica_set import ReplicaSet
from gateway.upstream.routing import RoutingConfig
from pagoda.v1 import common_pb2, engine_pb2
from tests.gateway.fake_engine import FakeEngine
from tests.gateway.test_replica_set import serving


def _token(seed: int, position: int, history: list[int]) -> int:
    digest = hashlib.blake2b(f"{seed}/{position}/{history[-3:]}".encode(), digest_size=8).digest()
    return 100 + int.from_bytes(digest, "little") % 1500  # ordinary tokens of the tiny vocabulary


@dataclass(slots=True)
class SeededEngine(FakeEngine):
    """Streams `tokens_per_response` tokens per message up to max_tokens (else 40), each from
    _token(); with `break_after_tokens`, its first request fails UNAVAILABLE after that many."""

    break_after_tokens: int | None = None
    break_code: grpc.StatusCode = grpc.StatusCode.UNAVAILABLE

    async def Generate(self, request, context):
        first = not self.requests
        self.requests.append(request)
        sampling = request.sampling
        history = list(request.prompt_token_ids)
        limit = sampling.max_tokens if sampling.HasField("max_tokens") else 40
        position, sent = request.num_prior_output_tokens, 0
        while sent < limit:
            if first and self.break_after_tokens is not None and sent >= self.break_after_tokens:
                await context.abort(self.break_code, "the worker was lost")
            tokens = []
            for _ in range(min(self.tokens_per_response, limit - sent)):
                tokens.append(_token(sampling.seed, position, history))
                history.append(tokens[-1])
                position += 1
            sent += len(tokens)
            done = sent >= limit
            yield engine_pb2.GenerateResponse(
                request_id=request.request_id,
                sequences=[engine_pb2.SequenceDelta(
                    index=0, token_ids=tokens,
                    finish_reason=common_pb2.FINISH_REASON_LENGTH if done else 0)],
                num_prompt_tokens=len(request.prompt_token_ids) if sent == len(tokens) else 0,
                num_cached_tokens=5 if sent == len(tokens) else 0, finished=done)


def _engine(**fields) -> SeededEngine:
    return SeededEngine(model_name="m", scripts=[[]], tokens_per_response=3, **fields)


@contextlib.asynccontextmanager
async def replica_set(*engines: FakeEngine, **routing):
    async with contextlib.AsyncExitStack() as stack:
        targets = [(await stack.enter_async_context(serving(e)))[0] for e in engines]
        replicas = ReplicaSet(targets, RoutingConfig(**{"policy": "round-robin", **routing}), timeout_s=2.0)
        stack.push_async_callback(replicas.close)
        yield replicas


def _request(max_tokens: int = 10, min_tokens: int = 0, n: int = 1) -> engine_pb2.GenerateRequest:
    sampling = common_pb2.SamplingParams(max_tokens=max_tokens, min_tokens=min_tokens, seed=1234, n=n,
                                         temperature=0.8, prompt_logprobs=2)
    return engine_pb2.GenerateRequest(request_id="r", prompt_token_ids=[7, 8, 9], sampling=sampling)


async def _responses(replicas: ReplicaSet, request: engine_pb2.GenerateRequest) -> list:
    return [r async for r in replicas.generate(request)]


def _tokens(responses) -> list[int]:
    return [t for r in responses for d in r.sequences for t in d.token_ids]


def _count(counter, *labels) -> float:
    return counter.labels(*labels)._value.get()


async def test_a_stream_whose_replica_fails_mid_way_goes_on_on_another_with_the_same_tokens():
    async with replica_set(_engine(), _engine()) as replicas:
        undisturbed = _tokens(await _responses(replicas, _request(min_tokens=6)))
    assert len(undisturbed) == 10
    breaking, other = _engine(break_after_tokens=3), _engine()
    failovers, failed = _count(metrics.ROUTER_STREAM_FAILOVERS, "0"), _count(metrics.ROUTER_STREAMS_FAILED, "0")
    async with replica_set(breaking, other) as replicas:
        responses = await _responses(replicas, _request(min_tokens=6))
    assert _tokens(responses) == undisturbed
    assert responses[-1].finished and responses[-1].sequences[-1].finish_reason == common_pb2.FINISH_REASON_LENGTH
    # The continuation: prompt + the 3 tokens streamed, marked as earlier output, limits reduced.
    (carried,) = other.requests
    assert list(carried.prompt_token_ids) == [7, 8, 9, *undisturbed[:3]]
    assert carried.num_prior_output_tokens == 3 and carried.request_id == "r"
    s = carried.sampling
    assert (s.max_tokens, s.min_tokens, s.seed, s.temperature) == (7, 3, 1234, pytest.approx(0.8))
    assert not s.HasField("prompt_logprobs")  # the first replica streamed them already
    # Prompt facts stay the first replica's: the original prompt, its cache hits.
    assert [(r.num_prompt_tokens, r.num_cached_tokens) for r in responses if r.num_prompt_tokens] == [(3, 5)]
    assert _count(metrics.ROUTER_STREAM_FAILOVERS, "0") == failovers + 1
    assert _count(metrics.ROUTER_STREAMS_FAILED, "0") == failed


async def test_a_continuation_that_fails_too_goes_on_once_more_then_the_budget_ends_it():
    engines = [_engine(break_after_tokens=3) for _ in range(4)]
    async with replica_set(*engines) as replicas:  # max_stream_failovers 2 (the default)
        received = []
        with pytest.raises(UpstreamError) as error:
            async for response in replicas.generate(_request(max_tokens=20)):
                received.append(response)
    assert error.value.grpc_code == grpc.StatusCode.UNAVAILABLE
    assert len(_tokens(received)) == 9  # 3 from each of the three replicas tried
    assert [len(e.requests) for e in engines] == [1, 1, 1, 0]
    assert [e.requests[0].num_prior_output_tokens for e in engines[:3]] == [0, 3, 6]


async def test_request_errors_and_streams_of_several_sequences_are_not_carried_on():
    for failing, request in ((_engine(break_after_tokens=3, break_code=grpc.StatusCode.INTERNAL), _request()),
                             (_engine(break_after_tokens=3), _request(n=2))):
        other = _engine()
        async with replica_set(failing, other) as replicas:
            with pytest.raises(UpstreamError):
                await _responses(replicas, request)
        assert not other.requests, request


async def test_failover_is_off_with_a_budget_of_zero():
    other = _engine()
    async with replica_set(_engine(break_after_tokens=3), other, max_stream_failovers=0) as replicas:
        with pytest.raises(UpstreamError):
            await _responses(replicas, _request())
    assert not other.requests


async def _stream_text(engines: list[SeededEngine], tokenizer) -> tuple[str, list, object]:
    """A streamed completion through the whole gateway (the real openai client): text, chunks, usage."""
    async with replica_set(*engines) as replicas:
        state = GatewayState(GatewayConfig(scheduler=replicas.target), replicas, tokenizer=tokenizer)
        await state.connect()
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=create_app(state)),
                                     base_url="http://gateway") as http:
            client = openai.AsyncOpenAI(base_url="http://gateway/v1", api_key="x", http_client=http)
            stream = await client.completions.create(
                model=state.pools.default.name, prompt=[7, 8, 9], max_tokens=12, seed=1234, temperature=0.8,
                stream=True, stream_options={"include_usage": True})
            chunks = [chunk async for chunk in stream]
    text = "".join(c.text for chunk in chunks for c in chunk.choices)
    return text, chunks, chunks[-1].usage


async def test_the_client_sees_one_uninterrupted_stream(tokenizer):
    expected, _, expected_usage = await _stream_text([_engine(), _engine()], tokenizer)
    breaking = _engine(break_after_tokens=6)
    text, chunks, usage = await _stream_text([breaking, _engine()], tokenizer)
    assert len(breaking.requests) == 1 and text == expected
    assert len({chunk.id for chunk in chunks}) == 1
    assert {c.index for chunk in chunks for c in chunk.choices} == {0}
    assert [c.finish_reason for chunk in chunks for c in chunk.choices if c.finish_reason] == ["length"]
    assert (usage.prompt_tokens, usage.completion_tokens) == (3, 12) == (
        expected_usage.prompt_tokens, expected_usage.completion_tokens)
