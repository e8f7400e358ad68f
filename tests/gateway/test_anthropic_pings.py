"""A streamed message pings while its prompt is prefilled: Claude Code drops a stream silent for 300 s."""

from __future__ import annotations

import asyncio
import json

from gateway.anthropic import events
from gateway.generation import GenerationStep, SequenceChunk, Usage


def _types(lines: list[str]) -> list[str]:
    return [json.loads(line.split("data: ", 1)[1])["type"] for line in lines]


async def test_pings_until_the_first_token_then_the_message(monkeypatch):
    monkeypatch.setattr(events, "PING_INTERVAL_S", 0.01)
    prefilled = asyncio.Event()

    async def steps():
        await prefilled.wait()  # the prefill: no step for a long while
        yield GenerationStep([SequenceChunk(0, "hi", [7], finish_reason="stop")],
                             usage=Usage(prompt_tokens=3, completion_tokens=1, cached_tokens=0))

    stream = events.message_events(steps(), "msg_1", "m", 3, parser=None)
    lines = []
    async for line in stream:
        lines.append(line)
        if _types(lines).count("ping") == 4:
            prefilled.set()
    types = _types(lines)
    assert types[:5] == ["message_start", "ping", "ping", "ping", "ping"]
    assert types[5:] == ["content_block_start", "content_block_delta", "content_block_stop",
                         "message_delta", "message_stop"]


async def test_a_client_leaving_during_the_prefill_closes_the_steps(monkeypatch):
    monkeypatch.setattr(events, "PING_INTERVAL_S", 0.01)
    closed = asyncio.Event()

    async def steps():
        try:
            await asyncio.Event().wait()  # never prefilled
            yield  # pragma: no cover
        finally:
            closed.set()

    stream = events.message_events(steps(), "msg_1", "m", 3, parser=None)
    assert _types([await anext(stream) for _ in range(3)]) == ["message_start", "ping", "ping"]
    await stream.aclose()
    assert closed.is_set()
