"""Images of a chat request (docs/vision.md): limits, data URLs, gated http(s) fetches, decoding.

Every image is fetched and decoded before the request reaches a model pool, so a bad one is a 400
naming its part (`messages[0].content[1]: ...`) and costs the engine nothing. http(s) URLs are
fetched by the gateway only (never a worker), only from `--allowed-media-domains` (none by default:
a server that fetches any URL a client names is an SSRF hole), with a timeout and a size cap.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import grpc
import httpx

from gateway.errors import GatewayError
from gateway.openai.chat_messages import ChatMessage, ImageUrlPart
from pagoda.contract.errors import InvalidRequestError
from pagoda.contract.image_inputs import ImageError, ImageLimits, decode_image

DEFAULT_IMAGES_PER_PROMPT = 4


class BadImageError(GatewayError):
    """A 400 whose `param` is the image part (`messages[0].content[1]`), as OpenAI names a bad field."""

    http_status, grpc_code = 400, grpc.StatusCode.INVALID_ARGUMENT


@dataclass(frozen=True, slots=True)
class MediaConfig:
    max_images_per_prompt: int = DEFAULT_IMAGES_PER_PROMPT  # --limit-mm-per-prompt '{"image": N}'
    allowed_media_domains: tuple[str, ...] = ()  # http(s) image URLs from these hosts; () refuses all
    fetch_timeout_s: float = 5.0
    limits: ImageLimits = ImageLimits()


def parse_limit_mm_per_prompt(text: str | None) -> int:
    """vLLM's `--limit-mm-per-prompt '{"image": 2}'` -> images per prompt (other modalities refused)."""
    if not text:
        return DEFAULT_IMAGES_PER_PROMPT
    try:
        limits = json.loads(text)
    except json.JSONDecodeError as error:
        raise ValueError(f"--limit-mm-per-prompt must be JSON such as '{{\"image\": 2}}': {error}") from None
    if not isinstance(limits, dict) or set(limits) - {"image"} or not isinstance(limits.get("image", 0), int):
        raise ValueError(f"--limit-mm-per-prompt: only {{\"image\": N}} is served, got {text}")
    return int(limits.get("image", DEFAULT_IMAGES_PER_PROMPT))


def image_parts(messages: Sequence[ChatMessage]) -> list[tuple[str, ImageUrlPart]]:
    """(where, part) of every image part, in prompt order."""
    return [(part.where or f"messages[{i}].content[{j}]", part)
            for i, message in enumerate(messages) for j, part in message.image_parts()]


async def load_images(messages: Sequence[ChatMessage], config: MediaConfig) -> list[Any]:
    """The decoded RGB images of `messages`, in order; InvalidRequestError naming the first bad part."""
    parts = image_parts(messages)
    if len(parts) > config.max_images_per_prompt:
        raise InvalidRequestError(f"{len(parts)} images in the prompt; at most {config.max_images_per_prompt} "
                                  "are allowed (--limit-mm-per-prompt)")
    images = []
    for where, part in parts:
        try:
            data = await _image_bytes(part.image_url.url, config)
            images.append(await asyncio.to_thread(decode_image, data, config.limits))
        except ImageError as error:
            raise BadImageError(f"{where}: {error}", param=where) from None
    return images


async def _image_bytes(url: str, config: MediaConfig) -> bytes:
    if url.startswith("data:"):
        header, sep, payload = url.partition(",")
        if not sep or not header.endswith(";base64"):
            raise ImageError("a data URL image must be base64 (data:image/png;base64,...)")
        if len(payload) > config.limits.max_bytes * 4 // 3 + 4:
            raise ImageError(f"the image is over {config.limits.max_bytes} bytes")
        try:
            return base64.b64decode(payload, validate=True)
        except (binascii.Error, ValueError):
            raise ImageError("the data URL is not valid base64") from None
    scheme, host = urlsplit(url).scheme, urlsplit(url).hostname or ""
    if scheme not in ("http", "https"):
        raise ImageError("an image URL must be a base64 data URL or http(s)")
    if host not in config.allowed_media_domains:
        raise ImageError(f"image URLs from {host!r} are refused: the gateway fetches only from "
                         "--allowed-media-domains (send the image as a base64 data URL)")
    return await _fetch(url, config)


async def _fetch(url: str, config: MediaConfig) -> bytes:
    """GET with a timeout, no redirects (a redirect could leave the allow-list), a streamed size cap."""
    cap = config.limits.max_bytes
    try:
        async with httpx.AsyncClient(timeout=config.fetch_timeout_s, follow_redirects=False) as client:
            async with client.stream("GET", url) as response:
                if response.status_code != 200:
                    raise ImageError(f"fetching the image URL answered HTTP {response.status_code}")
                chunks, size = [], 0
                async for chunk in response.aiter_bytes():
                    size += len(chunk)
                    if size > cap:
                        raise ImageError(f"the image at the URL is over {cap} bytes")
                    chunks.append(chunk)
                return b"".join(chunks)
    except httpx.HTTPError as error:
        raise ImageError(f"fetching the image URL failed: {type(error).__name__}") from None
