"""A streamed response whose text the tool parser holds back (a possible call, hermes_scan.py)
still sends an event every KEEPALIVE_S: Codex drops a stream with no event for 300 s, and a slow
model writing a fenced call on a busy CPU was silent that long (docs/agents.md)."""

from __future__ import annotations

import itertools

from gateway.generation import GenerationStep, SequenceChunk, Usage
from gateway.openai.responses_api import serving
from gateway.openai.responses_api.protocol import ResponsesRequest
from gateway.openai.tool_parsers import HermesToolParser

PIECES = ["I'll run it:\n", "```json\n", '{"name": "exec_command", ', '"arguments": {"cmd": "ls"}}', "\n```"]


async def test_held_text_sends_in_progress_events_then_the_call(monkeypatch):
    clock = itertools.count(0, 10)  # each look at the clock: 10 s later
    monkeypatch.setattr(serving, "_now", lambda: next(clock))
    body = ResponsesRequest.model_validate({"model": "m", "input": "edit", "stream": True})
    writer = serving.ResponseWriter(body, "resp_1", "m", HermesToolParser(None, ["exec_command"]))
    last = len(PIECES) - 1
    steps = [GenerationStep([SequenceChunk(0, text, [i], finish_reason="stop" if i == last else None)],
                            usage=Usage(3, len(PIECES), 0) if i == last else None) for i, text in enumerate(PIECES)]

    async def rest():
        for step in steps[1:]:
            yield step

    events = [e async for e in writer.events(steps[0], rest())]
    types = [e["type"] for e in events]
    # t=10: the text; t=20: the fence held (10 s: nothing); t=30: the object begun, held 20 s: alive
    assert types[:2] == ["response.created", "response.in_progress"]
    keepalive = types.index("response.in_progress", 2)
    assert types[keepalive - 1] == "response.output_text.delta" and types.count("response.in_progress") == 2
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta") == PIECES[0]
    final = events[-1]["response"]
    assert final["status"] == "completed" and final["output"][-1]["type"] == "function_call"
    assert final["output"][-1]["name"] == "exec_command" and final["output"][-1]["arguments"] == '{"cmd": "ls"}'
