"""A test double of the scheduler's pagoda.v1.Engine: streams scripted token ids, injects failures.

Deterministic: sequence i of every request streams `scripts[i % len(scripts)]`, `tokens_per_response`
ids per message, finishing with "length" at max_tokens and "stop" when the script runs out. A
pooling request's last response carries `fake_embedding(prompt)`.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import grpc

from pagoda.v1 import common_pb2, engine_pb2, engine_pb2_grpc

FAKE_TIMINGS = common_pb2.RequestTimings(queue_seconds=0.001, prefill_seconds=0.002, decode_seconds=0.004,
                                        time_to_first_token_seconds=0.003, total_seconds=0.007)


@dataclass(slots=True)
class FakeEngine(engine_pb2_grpc.EngineServicer):
    model_name: str
    scripts: list[list[int]]
    max_model_len: int = 256
    vocab_size: int = 2048
    tokens_per_response: int = 2
    fail_code: grpc.StatusCode | None = None  # Generate fails with this before any token
    fail_after_responses: int | None = None  # then INTERNAL mid-stream
    gate: asyncio.Event | None = None  # when set: each response waits for it (clients can leave)
    # Hold the final response until the caller cancels, like an engine still generating: a test
    # then sees a cancel only if the gateway sent one, never a natural end that raced it.
    hold_final_response: bool = False
    num_cached_tokens: int = 0  # the prefix-cache hits every request reports
    # The scheduler's timings, on each request's last response (as a real scheduler sends them).
    timings: common_pb2.RequestTimings = field(default_factory=lambda: FAKE_TIMINGS)
    requests: list[engine_pb2.GenerateRequest] = field(default_factory=list)
    active: set[str] = field(default_factory=set)  # request ids streaming now
    cancelled: list[str] = field(default_factory=list)  # request ids whose caller left early
    responses_sent: int = 0
    ended_sessions: list[tuple[str, str]] = field(default_factory=list)  # EndSession calls
    # Session save / restore: the calls as (session id, salt), and the status they fail with (None: OK)
    saved_sessions: list[tuple[str, str]] = field(default_factory=list)
    restored_sessions: list[tuple[str, str, float, str]] = field(default_factory=list)
    snapshot_error: tuple[grpc.StatusCode, str] | None = None

    async def Generate(self, request, context):
        self.requests.append(request)
        if self.fail_code is not None:
            await context.abort(self.fail_code, f"fake engine says {self.fail_code.name}")
        self.active.add(request.request_id)
        finished = False
        try:
            async for response in self._responses(request):
                if self.fail_after_responses is not None and self.responses_sent >= self.fail_after_responses:
                    await context.abort(grpc.StatusCode.INTERNAL, "fake engine failed mid-stream")
                if self.gate is not None:
                    await self.gate.wait()
                if response.finished and self.hold_final_response:
                    await asyncio.Event().wait()  # only a cancel (the caller leaving) ends this
                self.responses_sent += 1
                finished = response.finished
                yield response
        finally:
            self.active.discard(request.request_id)
            if not finished:
                self.cancelled.append(request.request_id)

    async def _responses(self, request):
        sampling = request.sampling
        n = sampling.n if sampling.HasField("n") else 1
        limit = sampling.max_tokens if sampling.HasField("max_tokens") else self.max_model_len
        limit = min(limit, self.max_model_len - len(request.prompt_token_ids))
        outputs = [self.scripts[i % len(self.scripts)] for i in range(n)]
        total = max(min(len(tokens), limit) for tokens in outputs)
        for start in range(0, total, self.tokens_per_response):
            deltas = [self._delta(i, tokens, start, limit, sampling) for i, tokens in enumerate(outputs)]
            deltas = [d for d in deltas if d is not None]
            response = engine_pb2.GenerateResponse(
                request_id=request.request_id, sequences=deltas,
                num_prompt_tokens=len(request.prompt_token_ids) if start == 0 else 0,
                num_cached_tokens=self.num_cached_tokens if start == 0 else 0,
                finished=start + self.tokens_per_response >= total)
            if response.finished:
                response.timings.CopyFrom(self.timings)
                if sampling.pooling:  # a vector only its prompt decides (a real one: worker_svc/pooling.py)
                    response.embedding.extend(fake_embedding(request.prompt_token_ids))
            if start == 0 and sampling.HasField("prompt_logprobs"):  # with the first tokens, once
                response.prompt_logprobs.extend(fake_prompt_logprobs(request.prompt_token_ids,
                                                                     sampling.prompt_logprobs))
            yield response
            await asyncio.sleep(0)  # let the caller run between responses, like a real engine

    def _delta(self, index, tokens, start, limit, sampling):
        end = min(start + self.tokens_per_response, len(tokens), limit)
        if start >= end:
            return None
        delta = engine_pb2.SequenceDelta(index=index, token_ids=tokens[start:end])
        if sampling.HasField("logprobs"):
            for position in range(start, end):
                delta.logprobs.append(fake_logprobs(tokens[position], position, sampling.logprobs))
        if end >= limit:
            delta.finish_reason = common_pb2.FINISH_REASON_LENGTH
        elif end >= len(tokens):
            delta.finish_reason = common_pb2.FINISH_REASON_STOP
        return delta

    async def Abort(self, request, context):
        return engine_pb2.AbortResponse(found=request.request_id in self.active)

    async def EndSession(self, request, context):
        """Found when a request of that session (and salt) came through and it was not ended yet."""
        key = (request.session_id, request.cache_salt)
        live = {(r.session_id, r.cache_salt) for r in self.requests if r.session_id}
        found = key in live and key not in self.ended_sessions
        self.ended_sessions.append(key)
        return engine_pb2.EndSessionResponse(found=found)

    async def SaveSession(self, request, context):
        """Saved when a request of that session (and salt) came through here; else NOT_FOUND."""
        self.saved_sessions.append((request.session_id, request.cache_salt))
        if self.snapshot_error is not None:
            await context.abort(*self.snapshot_error)
        if (request.session_id, request.cache_salt) not in {(r.session_id, r.cache_salt) for r in self.requests}:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"session {request.session_id!r} holds no lease here")
        return engine_pb2.SessionSnapshot(session_id=request.session_id, num_tokens=32, num_blocks=2,
                                          num_bytes=4096, path=f"/snapshots/{request.session_id}")

    async def RestoreSession(self, request, context):
        self.restored_sessions.append((request.session_id, request.cache_salt, request.ttl_s, request.tenant))
        if self.snapshot_error is not None:
            await context.abort(*self.snapshot_error)
        return engine_pb2.SessionSnapshot(session_id=request.session_id, num_tokens=32, num_blocks=2,
                                          num_bytes=4096, path=f"/snapshots/{request.session_id}",
                                          num_cached_tokens=16)

    async def GetInfo(self, request, context):
        return engine_pb2.EngineInfo(model_name=self.model_name, max_model_len=self.max_model_len,
                                     block_size=16, num_blocks=64, eos_token_ids=[1],
                                     vocab_size=self.vocab_size, max_num_seqs=8)

    async def GetStats(self, request, context):
        return engine_pb2.EngineStats(idle=not self.active, invariant_ok=True)


def fake_embedding(prompt_ids) -> list[float]:
    return [float(len(prompt_ids)), float(sum(prompt_ids) % 97), float(prompt_ids[0])]


def fake_logprobs(token_id: int, position: int, num_top: int) -> common_pb2.TokenLogprobs:
    """Chosen token's logprob -0.5 - 0.1*position; top k: the token itself, then token_id+1, ..."""
    chosen = -0.5 - 0.1 * position
    top = [common_pb2.TopLogprob(token_id=token_id + j, logprob=chosen - j) for j in range(num_top)]
    return common_pb2.TokenLogprobs(logprob=chosen, top=top)


def fake_prompt_logprobs(prompt_ids, num_top: int) -> list[common_pb2.TokenLogprobs]:
    """Prompt token i (from 1): logprob -1 - 0.01*i, rank i; top k: the token itself, then +1, ..."""
    out = []
    for i, token_id in enumerate(prompt_ids[1:], start=1):
        chosen = -1.0 - 0.01 * i
        top = [common_pb2.TopLogprob(token_id=token_id + j, logprob=chosen - j) for j in range(num_top)]
        out.append(common_pb2.TokenLogprobs(logprob=chosen, top=top, rank=i))
    return out
