"""Anthropic's routes on the gateway's HTTP app. Errors under /v1/messages take Anthropic's shape
(gateway.errors.error_body: the app's one set of error handlers picks the shape by path)."""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.responses import Response

from gateway.anthropic.protocol import MessagesRequest
from gateway.anthropic.serving_messages import create_message
from gateway.state import GatewayState


def add_anthropic_routes(app: FastAPI, state: GatewayState) -> None:
    @app.post("/v1/messages")
    async def messages(body: MessagesRequest, request: Request) -> Response:
        return await create_message(body, request, state)
