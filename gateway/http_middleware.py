"""Pure ASGI middlewares: API key, request body size cap, request counting.

Written at the ASGI level (not BaseHTTPMiddleware) so streaming responses and client
disconnects pass through untouched.
"""

from __future__ import annotations

import json

from gateway import metrics
from gateway.auth import OPEN_HTTP_PATHS, bearer_token_ok
from gateway.errors import openai_error_body


async def _send_error(send, status: int, message: str, headers: list | None = None) -> None:
    body = json.dumps(openai_error_body(status, message)).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", str(len(body)).encode()), *(headers or [])]})
    await send({"type": "http.response.body", "body": body})


def _header(scope, name: bytes) -> str | None:
    for key, value in scope.get("headers", ()):
        if key == name:
            return value.decode("latin-1")
    return None


class ApiKeyMiddleware:
    def __init__(self, app, api_key: str | None) -> None:
        self.app, self.api_key = app, api_key

    async def __call__(self, scope, receive, send) -> None:
        if (scope["type"] == "http" and scope["path"] not in OPEN_HTTP_PATHS
                and not bearer_token_ok(_header(scope, b"authorization"), self.api_key)):
            await _send_error(send, 401, "Unauthorized: a valid API key is required",
                              [(b"www-authenticate", b"Bearer")])
            return
        await self.app(scope, receive, send)


class BodySizeLimitMiddleware:
    """413 for bodies over `max_bytes`: by Content-Length up front, else while reading."""

    def __init__(self, app, max_bytes: int) -> None:
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = _header(scope, b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            await self._reject(send)
            return
        messages, size = [], 0
        while True:  # bounded: stops at max_bytes; chunked bodies are read before routing
            message = await receive()
            messages.append(message)
            size += len(message.get("body", b""))
            if size > self.max_bytes:
                await self._reject(send)
                return
            if message["type"] != "http.request" or not message.get("more_body", False):
                break
        await self.app(scope, _replay(messages, receive), send)

    async def _reject(self, send) -> None:
        await _send_error(send, 413, f"request body larger than {self.max_bytes} bytes")


def _replay(messages: list, receive):
    async def replayed():
        return messages.pop(0) if messages else await receive()
    return replayed


class RequestCounterMiddleware:
    def __init__(self, app, routes: frozenset[str]) -> None:
        self.app, self.routes = app, routes  # other paths count as "other": bounded label values

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        route = scope["path"] if scope["path"] in self.routes else "other"

        async def counting_send(message) -> None:
            if message["type"] == "http.response.start":
                metrics.HTTP_REQUESTS.labels(route=route, status=str(message["status"])).inc()
            await send(message)

        await self.app(scope, receive, counting_send)
