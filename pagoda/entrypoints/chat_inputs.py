"""`LLM.chat`'s messages (OpenAI's shape, as vLLM's `LLM.chat` takes them) -> one prompt with its images.

Content is a string or a list of parts: `{"type": "text", "text": ...}`, `{"type": "image_url",
"image_url": {"url": "data:image/...;base64,..."}}` (offline nothing is fetched: no http URLs), or
`{"type": "image_pil", "image_pil": PIL.Image}` (vLLM's). Image parts render as the template's
image placeholder; the images come back in prompt order, for `multi_modal_data`.
"""

from __future__ import annotations

import base64
import binascii
from collections.abc import Sequence
from typing import Any

from pagoda.contract.image_inputs import decode_image


def chat_prompt(messages: Sequence[dict[str, Any]]) -> tuple[list[dict[str, Any]], list[Any]]:
    """(the messages as the chat template takes them, their images in order)."""
    rendered, images = [], []
    for i, message in enumerate(messages):
        content = message.get("content")
        if not isinstance(content, list):
            rendered.append(dict(message))
            continue
        parts = []
        for j, part in enumerate(content):
            kind = part.get("type")
            if kind == "text":
                parts.append({"type": "text", "text": part.get("text", "")})
            elif kind in ("image_url", "image_pil"):
                images.append(_image(part, f"messages[{i}].content[{j}]"))
                parts.append({"type": "image"})
            else:
                raise ValueError(f"messages[{i}].content[{j}]: parts of type {kind!r} are not served")
        if not images:  # text parts only: the string a text model's template expects
            parts = "".join(p["text"] for p in parts)
        rendered.append({**message, "content": parts})
    return rendered, images


def _image(part: dict[str, Any], where: str) -> Any:
    if part["type"] == "image_pil":
        return part["image_pil"].convert("RGB")
    url = (part.get("image_url") or {}).get("url", "")
    header, sep, payload = url.partition(",")
    if not (url.startswith("data:") and sep and header.endswith(";base64")):
        raise ValueError(f"{where}: offline, an image_url must be a base64 data URL (nothing is fetched)")
    try:
        return decode_image(base64.b64decode(payload, validate=True))
    except (binascii.Error, ValueError) as error:
        raise ValueError(f"{where}: {error}") from None
