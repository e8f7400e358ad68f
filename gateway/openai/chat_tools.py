"""Tool calling in /v1/chat/completions: the plan for a request, and the calls out of its choices
(whole replies, or streamed deltas: content flows until a call may start; a call's header goes
out once its name is known, its arguments when it is complete)."""

from __future__ import annotations

import dataclasses
import re
from typing import Any

from gateway.openai.protocol import ChatCompletionRequest
from gateway.openai.responses import ChatChoice
from gateway.openai.tool_calls import (
    ToolPlan,
    content_before_calls,
    extract_tool_calls,
    plan_tools,
    render_messages,
    template_knows_tools,
)
from gateway.openai.tool_protocol import DeltaFunctionCall, DeltaToolCall, ToolCall
from pagoda.contract.errors import InvalidRequestError
from pagoda.contract.params import SamplingParams


def tool_plan(body: ChatCompletionRequest, parser: str, auto_enabled: bool) -> ToolPlan:
    return plan_tools(body.tools, body.tool_choice, parser, auto_enabled)


def with_forced_call(sampling: SamplingParams, plan: ToolPlan) -> SamplingParams:
    """The sampling params with the grammar of a required / named call, if the plan forces one."""
    if plan.forced is None:
        return sampling
    if sampling.structured_outputs is not None:
        raise InvalidRequestError("a required or named tool_choice cannot be combined with "
                                  "response_format or structured outputs")
    return dataclasses.replace(sampling, structured_outputs=plan.forced)


def template_messages(body: ChatCompletionRequest, chat_template: str | None,
                      plan: ToolPlan) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """The messages and template kwargs: tools listed only when the model may call them."""
    messages = [m.as_template_dict() for m in body.messages]
    tools = body.tools if plan.parser is not None else None
    return render_messages(messages, tools, template_knows_tools(chat_template))


def _kept(calls: list[ToolCall], parallel: bool | None) -> list[ToolCall]:
    return calls[:1] if parallel is False else calls


def finish_choice(choice: ChatChoice, plan: ToolPlan, parallel: bool | None) -> None:
    """A whole reply: calls out of its text into message.tool_calls (finish_reason "tool_calls")."""
    if plan.parser is None or choice.message.content is None:
        return
    content, calls = extract_tool_calls(choice.message.content, plan.parser)
    if calls:
        choice.message.content = content
        choice.message.tool_calls = _kept(calls, parallel)
        if choice.finish_reason == "stop":
            choice.finish_reason = "tool_calls"


_HEADS = {  # where a call's name is known: its header delta can go out before its arguments
    "hermes": re.compile(r'<tool_call>\s*\{\s*"name"\s*:\s*"([^"]*)"'),
    "llama3_json": re.compile(r'(?:^|;)\s*(?:<\|python_tag\|>)?\s*\{\s*"name"\s*:\s*"([^"]*)"'),
}


class ToolDeltas:
    """Per streamed choice: the text held back while it may be (part of) a call. As OpenAI streams
    calls: a header delta (index, id, type, name, arguments "") as soon as a call's name is known,
    then its arguments once the call is complete (the reply's end), then finish_reason
    "tool_calls"."""

    def __init__(self, n: int, plan: ToolPlan, parallel: bool | None) -> None:
        self.parser = plan.parser
        self.parallel = parallel
        self.held = [""] * n
        self.sent_content = [False] * n  # any content streamed yet (llama3_json calls start the reply)
        self.heads: list[list[str]] = [[] for _ in range(n)]  # the ids of the headers sent

    def feed(self, index: int, text: str, finish_reason: str | None
             ) -> tuple[str, list[DeltaToolCall] | None, str | None]:
        """(content to send now, tool-call deltas, finish_reason to send)."""
        if self.parser is None:
            return text, None, finish_reason
        held = self.held[index] + text
        if finish_reason is None:
            cut = content_before_calls(held, self.parser) if not self._content_only(index) else len(held)
            self.held[index] = held[cut:]
            self.sent_content[index] |= bool(held[:cut].strip())
            return held[:cut], self._new_heads(index) or None, None
        self.held[index] = ""
        content, calls = extract_tool_calls(held, self.parser)
        if not calls:
            return held, None, finish_reason
        calls = _kept(calls, self.parallel)
        heads = self.heads[index]
        deltas = []
        for i, call in enumerate(calls):
            if i < len(heads):  # its header went out: the arguments only, under the same index
                deltas.append(DeltaToolCall(index=i, function=DeltaFunctionCall(arguments=call.function.arguments)))
            else:
                deltas.append(DeltaToolCall.whole(i, call))
        return content or "", deltas, "tool_calls" if finish_reason == "stop" else finish_reason

    def _new_heads(self, index: int) -> list[DeltaToolCall]:
        names = [m.group(1) for m in _HEADS[self.parser].finditer(self.held[index])]
        if self.parallel is False:
            names = names[:1]
        heads = self.heads[index]
        deltas = []
        for i in range(len(heads), len(names)):
            call = ToolCall.of(names[i], "")
            heads.append(call.id)
            deltas.append(DeltaToolCall(index=i, id=call.id, type="function",
                                        function=DeltaFunctionCall(name=names[i], arguments="")))
        return deltas

    def _content_only(self, index: int) -> bool:
        """llama3_json: a reply that began as text holds no call."""
        return self.parser == "llama3_json" and self.sent_content[index]
