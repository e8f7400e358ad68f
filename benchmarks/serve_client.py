"""One streamed OpenAI-API request with a timestamp per SSE chunk (httpx, no client-side retries).

httpx is used rather than the `openai` client: it hands over each `data:` line as it arrives, so
the timestamps are exact, and it never retries a 5xx behind the benchmark's back.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass

import httpx
from httpx_sse import EventSource

from benchmarks.serve_metrics import RequestRecord


@dataclass(frozen=True, slots=True)
class RequestSpec:
    prompt_token_ids: list[int]
    max_tokens: int
    prompt_text: str | None = None  # the chat endpoint needs text; completions sends the ids
    cache_salt: str | None = None
    session_id: str | None = None  # Pagoda's session lease (docs/kv_tiers.md); others get no such field


@dataclass(frozen=True, slots=True)
class Endpoint:
    base_url: str  # http://host:port (no /v1)
    model: str
    kind: str = "completions"  # or "chat"
    timeout_s: float = 300.0

    @property
    def url(self) -> str:
        path = "/v1/chat/completions" if self.kind == "chat" else "/v1/completions"
        return self.base_url.rstrip("/") + path


def request_body(endpoint: Endpoint, spec: RequestSpec) -> dict:
    """Greedy, EOS ignored, exactly max_tokens: every run does the same work."""
    body: dict = {"model": endpoint.model, "max_tokens": spec.max_tokens, "temperature": 0.0,
                  "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    if endpoint.kind == "chat":
        body["messages"] = [{"role": "user", "content": spec.prompt_text or ""}]
    else:
        body["prompt"] = spec.prompt_token_ids
    if spec.cache_salt is not None:
        body["cache_salt"] = spec.cache_salt
    if spec.session_id is not None:
        body["session_id"] = spec.session_id
    return body


async def send_request(client: httpx.AsyncClient, endpoint: Endpoint, spec: RequestSpec) -> RequestRecord:
    """Never raises for a failed request: the record says success=False and why."""
    record = RequestRecord(prompt_len=len(spec.prompt_token_ids), expected_output_len=spec.max_tokens)
    record.sent_at = time.perf_counter()
    try:
        async with asyncio.timeout(endpoint.timeout_s):
            await _stream_into(client, endpoint, spec, record)
    except TimeoutError:
        record.error = f"timed out after {endpoint.timeout_s}s"
    except httpx.HTTPError as error:
        record.error = f"{type(error).__name__}: {error}"
    record.finished_at = time.perf_counter()
    record.success = not record.error and bool(record.chunk_times)
    if record.success and not record.output_len:
        record.output_len = spec.max_tokens  # no usage chunk: trust ignore_eos + max_tokens
    if not record.success and not record.error:
        record.error = "stream ended without output"
    return record


async def _stream_into(client: httpx.AsyncClient, endpoint: Endpoint, spec: RequestSpec,
                       record: RequestRecord) -> None:
    async with client.stream("POST", endpoint.url, json=request_body(endpoint, spec)) as reply:
        if reply.status_code != 200:
            record.error = f"HTTP {reply.status_code}: {(await reply.aread()).decode(errors='replace')[:300]}"
            return
        async for event in EventSource(reply).aiter_sse():
            now = time.perf_counter()
            if event.data == "[DONE]":
                return
            if not _fold_chunk(json.loads(event.data), now, record):
                return


def _fold_chunk(chunk: dict, now: float, record: RequestRecord) -> bool:
    """Record one SSE event; False on an in-band error (the stream is then over for us)."""
    if "error" in chunk:
        record.error = f"stream error: {chunk['error'].get('message', chunk['error'])}"
        return False
    if any(_choice_text(choice) for choice in chunk.get("choices") or ()):
        record.chunk_times.append(now)
    usage = chunk.get("usage")
    if usage:
        record.output_len = int(usage.get("completion_tokens") or 0)
        record.prompt_len = int(usage.get("prompt_tokens") or record.prompt_len)
        record.cached_tokens = int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
    if chunk.get("timings"):  # Pagoda with --enable-request-timings: the server's own account
        record.timings = chunk["timings"]
    return True


def _choice_text(choice: dict) -> str:
    if "delta" in choice:  # chat chunk; the first one may carry only the role
        return (choice["delta"] or {}).get("content") or ""
    return choice.get("text") or ""


async def served_model(client: httpx.AsyncClient, base_url: str) -> dict:
    """The first model card of GET /v1/models."""
    reply = await client.get(base_url.rstrip("/") + "/v1/models", timeout=10.0)
    reply.raise_for_status()
    return reply.json()["data"][0]


async def detokenize(client: httpx.AsyncClient, base_url: str, model: str, token_ids: list[int]) -> str:
    reply = await client.post(base_url.rstrip("/") + "/detokenize",
                              json={"model": model, "tokens": token_ids}, timeout=30.0)
    reply.raise_for_status()
    return reply.json()["prompt"]


async def probe_vocab_size(client: httpx.AsyncClient, base_url: str, model: str, upper: int = 1 << 20) -> int:
    """The vocabulary size, found by bisecting on /detokenize, which rejects ids >= vocab_size.

    ~20 tiny requests; used only when neither --vocab-size nor the model card gives it.
    """
    url = base_url.rstrip("/") + "/detokenize"

    async def valid(token_id: int) -> bool:
        reply = await client.post(url, json={"model": model, "tokens": [token_id]}, timeout=10.0)
        if reply.status_code >= 500 or reply.status_code == 404:
            reply.raise_for_status()
        return reply.status_code == 200

    if not await valid(0):
        raise RuntimeError("/detokenize rejects token 0: cannot probe the vocabulary size")
    low, high = 0, upper  # invariant: low is valid, high is not (or the probe's ceiling)
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (middle, high) if await valid(middle) else (low, middle)
    return high
