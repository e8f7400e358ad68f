"""Anthropic's routes on the gateway's HTTP app: `POST /v1/messages` and its
`/v1/messages/count_tokens` (the prompt's tokens as the chat template renders it, tools included:
what Claude Code asks before it sends a long context). Errors under /v1/messages take Anthropic's
shape (gateway.errors.error_body: the app's one set of error handlers picks the shape by path)."""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.responses import Response

from gateway.anthropic.protocol import CountTokensRequest, MessagesRequest
from gateway.anthropic.serving_messages import create_message, to_chat_request
from gateway.openai.serving_chat import ToolPlan, chat_prompt_ids, tool_parser_class
from gateway.state import GatewayState


def add_anthropic_routes(app: FastAPI, state: GatewayState) -> None:
    @app.post("/v1/messages")
    async def messages(body: MessagesRequest, request: Request) -> Response:
        return await create_message(body, request, state)

    @app.post("/v1/messages/count_tokens")
    async def count_tokens(body: CountTokensRequest) -> dict:
        tokenizer, _ = state.pool(body.model).require_ready()
        chat = to_chat_request(body)
        # The tools as a generation would list them, whatever tool_choice: counting calls nothing.
        plan = ToolPlan(tool_parser_class(state.config, tokenizer), chat.tools if chat.tool_choice != "none" else None)
        return {"input_tokens": len(chat_prompt_ids(chat, tokenizer, plan))}
