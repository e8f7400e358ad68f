"""Request bodies are read as I-JSON (RFC 7493): a string holding a lone UTF-16 surrogate is refused.

JSON's `\\ud800` escape decodes to a Python str that is not Unicode text: it reached the tokenizer
(TypeError), the response encoder (UnicodeEncodeError) and became a 500, whichever field held it
(prompt, model, cache_salt...). Refused when the body is parsed, it is one 400 naming the field,
through FastAPI's own "JSON decode error" path and the gateway's one validation handler.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import Any

from fastapi import Request, Response
from fastapi.routing import APIRoute

_HIGH = r"\\u[dD][89abAB][0-9a-fA-F]{2}"
_LOW = r"\\u[dD][c-fC-F][0-9a-fA-F]{2}"
_LONE_ESCAPE = re.compile(rf"{_HIGH}(?!{_LOW})|(?<!{_HIGH}){_LOW}")  # where, for the message only


def _is_text(value: str) -> bool:
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:  # the only way a str fails: a surrogate code point
        return False
    return True


def lone_surrogate_path(value: Any) -> str | None:
    """The dotted path of the first string (value or key) holding a lone surrogate, else None.
    Iterative: a body nested as deep as json.loads allows must not overflow the stack here."""
    stack: list[tuple[str, Any]] = [("", value)]
    while stack:
        path, item = stack.pop()
        if isinstance(item, str):
            if not _is_text(item):
                return path or "body"
        elif isinstance(item, dict):
            for key, child in item.items():
                child_path = f"{path}.{key}" if path else str(key)
                if not _is_text(key):
                    return path or "body"
                stack.append((child_path, child))
        elif isinstance(item, list):
            stack.extend((f"{path}.{i}" if path else str(i), child) for i, child in enumerate(item))
    return None


class LoneSurrogateError(json.JSONDecodeError):
    """FastAPI turns a JSONDecodeError into a RequestValidationError (json_invalid): a 400."""


class IJSONRequest(Request):
    async def json(self) -> Any:
        if not hasattr(self, "_json"):
            body = await self.body()
            value = json.loads(body)
            if (where := lone_surrogate_path(value)) is not None:
                text = body.decode("utf-8", errors="replace")
                match = _LONE_ESCAPE.search(text)
                raise LoneSurrogateError(f"a lone UTF-16 surrogate in {where} is not Unicode text",
                                         text, match.start() if match else 0)
            self._json = value
        return self._json


class IJSONRoute(APIRoute):
    """The gateway's routes read their JSON bodies through IJSONRequest."""

    def get_route_handler(self) -> Callable[[Request], Any]:
        handler = super().get_route_handler()

        async def handle(request: Request) -> Response:
            return await handler(IJSONRequest(request.scope, request.receive))

        return handle
