"""The HTTP side of an answer both endpoints share: SSE framing (an error in-band, `[DONE]` last) and
cancelling the work when the client goes away."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable
from typing import Any, TypeVar

from fastapi import Request
from pydantic import BaseModel

from gateway.errors import ClientDisconnectedError, openai_error_body, to_client_error
from pagoda.runtime.logging import get_logger

log = get_logger(__name__)
T = TypeVar("T")


# Legal unescaped in JSON and in SSE, but line breaks to `str.splitlines` — which is how httpx's
# `iter_lines` and many other clients split a stream: a raw U+2028 in a token's text would cut that
# `data:` line in two on their side. Inside JSON they can only occur in strings, so escaping is exact.
_UNICODE_LINE_BREAKS = str.maketrans({"\x85": "\\u0085", "\u2028": "\\u2028", "\u2029": "\\u2029"})


def sse_event(payload: BaseModel | dict[str, Any], name: str | None = None) -> str:
    body = payload.model_dump_json() if isinstance(payload, BaseModel) else json.dumps(payload)
    head = f"event: {name}\n" if name else ""
    return f"{head}data: {body.translate(_UNICODE_LINE_BREAKS)}\n\n"


async def sse_stream(events: AsyncIterator[BaseModel | dict[str, Any]],
                     named: bool = False) -> AsyncIterator[str]:
    """SSE framing: each event as `data: ...`, a failure as an error event, always `[DONE]` last.
    `named` (the Responses API's framing): each event also as `event: <its type>`, and no `[DONE]`.

    A client disconnect cancels this generator (CancelledError is not caught), which closes
    `events` and so cancels the upstream call.
    """
    try:
        async for event in events:
            yield sse_event(event, _type_of(event) if named else None)
    except Exception as error:  # noqa: BLE001 - headers are gone: report in-band, then [DONE]
        client_error = to_client_error(error)
        log.warning("stream_failed", error=client_error.message, status=client_error.http_status)
        yield sse_event(openai_error_body(client_error.http_status, client_error.message),
                        "error" if named else None)
    if not named:
        yield "data: [DONE]\n\n"


def _type_of(event: BaseModel | dict[str, Any]) -> str | None:
    return event.get("type") if isinstance(event, dict) else getattr(event, "type", None)


async def until_disconnected(request: Request, work: Awaitable[T]) -> T:
    """Await `work`, cancelling it if the HTTP client goes away first (aborts upstream)."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_for_disconnect(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
    if not task.done() or task.cancelled():
        log.info("client_disconnected", path=request.url.path)
        raise ClientDisconnectedError("client disconnected")
    return task.result()


async def _wait_for_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass
