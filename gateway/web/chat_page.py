"""Serves the chat page (static/) at `/`: plain files, no build step, no templating.

The page holds no secrets, so it is served without an API key (gateway.tenancy.auth.OPEN_HTTP_PATHS);
the API calls it makes carry the key the user types. Its routes are left out of the OpenAPI
schema: they are not part of the API (and the schemathesis test fuzzes only the API)."""

from __future__ import annotations

from pathlib import Path

from fastapi import FastAPI
from fastapi.responses import FileResponse

STATIC = Path(__file__).resolve().parent / "static"
# URL path -> (file, content type); an explicit list: nothing else under static/ is reachable.
PAGE_FILES = {
    "/": ("index.html", "text/html; charset=utf-8"),
    "/static/chat.js": ("chat.js", "text/javascript; charset=utf-8"),
    "/static/chat.css": ("chat.css", "text/css; charset=utf-8"),
}


def _file_route(name: str, media_type: str):
    # A closure, not default arguments: FastAPI would read those as query parameters.
    async def serve() -> FileResponse:
        # no-cache: the browser revalidates (ETag), so an upgraded gateway's page is picked up
        return FileResponse(STATIC / name, media_type=media_type, headers={"Cache-Control": "no-cache"})

    return serve


def add_chat_page(app: FastAPI) -> None:
    for url_path, (name, media_type) in PAGE_FILES.items():
        # HEAD too: uptime checks and clients probing the base URL (`HEAD /`) get 200, not 405
        app.add_api_route(url_path, _file_route(name, media_type), methods=["GET", "HEAD"], include_in_schema=False)
