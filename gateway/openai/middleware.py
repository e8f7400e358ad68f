"""Pure ASGI middlewares: API key and tenant lease, request body size cap, request counting, the
log line of every 4xx; and
`admit`, how a handler admits its request through the lease the tenancy middleware opened.

Written at the ASGI level (not BaseHTTPMiddleware) so streaming responses and client
disconnects pass through untouched.
"""

from __future__ import annotations

import json
import uuid
from typing import TYPE_CHECKING

from gateway import metrics
from gateway.errors import error_body
from gateway.tenancy.auth import OPEN_HTTP_PATHS, bearer_token
from gateway.tenancy.leases import Lease, Tenancy
from pagoda.runtime.logging import get_logger

if TYPE_CHECKING:
    from gateway.generation import GenerationInput

log = get_logger(__name__)
LEASE_KEY = "pagoda_tenant_lease"  # in an HTTP request's scope["state"] (Starlette's request.state)


async def _send_error(send, status: int, message: str, headers: list | None = None, path: str = "") -> None:
    body = json.dumps(error_body(path, status, message)).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", str(len(body)).encode()), *(headers or [])]})
    await send({"type": "http.response.body", "body": body})


def _header(scope, name: bytes) -> str | None:
    for key, value in scope.get("headers", ()):
        if key == name:
            return value.decode("latin-1")
    return None


class TenancyMiddleware:
    """The API key names the tenant (401 when it names none); each request gets a `Lease` on its
    tenant's limits, which a generation handler admits through (`admit`). The rate-limit headers
    of the admission join the response, and the lease closes - slot freed, tokens settled - only
    once the response, a stream included, has ended or its client has gone."""

    def __init__(self, app, tenancy: Tenancy) -> None:
        self.app, self.tenancy = app, tenancy

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope["path"] in OPEN_HTTP_PATHS:
            await self.app(scope, receive, send)
            return
        # Authorization: Bearer KEY, or Anthropic's x-api-key: KEY (what its clients send)
        key = bearer_token(_header(scope, b"authorization")) or _header(scope, b"x-api-key")
        tenant = self.tenancy.authenticate(key)
        if tenant is None:
            await _send_error(send, 401, "Unauthorized: a valid API key is required",
                              [(b"www-authenticate", b"Bearer")], scope["path"])
            return
        lease = self.tenancy.lease(tenant)
        scope.setdefault("state", {})[LEASE_KEY] = lease

        async def send_with_headers(message) -> None:
            if message["type"] == "http.response.start" and (headers := lease.headers()):
                message = {**message, "headers": [*message.get("headers", ()),
                                                  *((k.encode(), v.encode()) for k, v in headers)]}
            await send(message)

        try:
            await self.app(scope, receive, send_with_headers)
        finally:
            lease.close()


def lease_of(scope) -> Lease:
    """The lease TenancyMiddleware opened for this HTTP request."""
    return scope["state"][LEASE_KEY]


def admit(http, request: GenerationInput, max_model_len: int) -> tuple[GenerationInput, Lease]:
    """An HTTP handler's admission (`http`: its Starlette Request): the request with the tenant's
    cache salt, and the lease, which TenancyMiddleware closes once the response has ended."""
    lease = lease_of(http.scope)
    return lease.admit(request, max_model_len), lease


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
            await self._reject(send, scope["path"])
            return
        messages, size = [], 0
        while True:  # bounded: stops at max_bytes; chunked bodies are read before routing
            message = await receive()
            messages.append(message)
            size += len(message.get("body", b""))
            if size > self.max_bytes:
                await self._reject(send, scope["path"])
                return
            if message["type"] != "http.request" or not message.get("more_body", False):
                break
        await self.app(scope, _replay(messages, receive), send)

    async def _reject(self, send, path: str) -> None:
        await _send_error(send, 413, f"request body larger than {self.max_bytes} bytes", path=path)


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


class ClientErrorLogMiddleware:
    """One info line per 4xx answer (`client_error`: method, route, status, error type, the field
    and message, the request id), so a client a server refuses leaves a trace in its log. The id is
    the request's `x-request-id` header or a new one, returned in the same header of the 4xx."""

    MESSAGE_CHARS = 300

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = 0
        request_id = _header(scope, b"x-request-id") or f"req_{uuid.uuid4().hex[:16]}"

        async def logging_send(message) -> None:
            nonlocal status
            if message["type"] == "http.response.start" and 400 <= message["status"] < 500:
                status = message["status"]
                message = {**message, "headers": [*message.get("headers", ()),
                                                  (b"x-request-id", request_id.encode("latin-1"))]}
            elif message["type"] == "http.response.body" and status:
                _log_client_error(scope, status, message.get("body", b""), request_id)
                status = 0  # the first body message holds the whole error
            await send(message)

        await self.app(scope, receive, logging_send)


def _log_client_error(scope, status: int, body: bytes, request_id: str) -> None:
    error_type = field = message = None
    try:
        error = json.loads(body or b"{}").get("error") or {}
        error_type, field, message = error.get("type"), error.get("param"), error.get("message")
    except (ValueError, AttributeError):
        pass
    if field is None and isinstance(message, str) and ": " in message:  # "tools.4.type: Input should be ..."
        head = message.split(": ", 1)[0]
        field = head if " " not in head else None
    log.info("client_error", method=scope.get("method"), route=scope.get("path"), status=status,
             error_type=error_type, field=field,
             message=message[:ClientErrorLogMiddleware.MESSAGE_CHARS] if isinstance(message, str) else None,
             request_id=request_id)
