"""The soak's request kinds and how each one's outcome is judged (benchmarks/soak.py drives them).

- normal: `/v1/completions`, greedy, `ignore_eos`, exactly max_tokens tokens, streamed or not; a
  fraction hangs up at a random moment (before the headers, or after a random number of chunks);
- bad: a malformed or out-of-range body; must get one 4xx with the OpenAI error shape;
- quota: a normal request under a tenant key with tight limits; either completes, or gets 429
  with `Retry-After` and OpenAI's `x-ratelimit-*` headers.

A valid request that does not complete is `failed` when the server said so (a status other than
200, an error chunk, a wrong token count) and `lost` when no final answer came (a timeout, a broken
connection, a stream without its finish_reason or `[DONE]`). Each request's kind, body and hang-up
moment come from its own generator, seeded by (seed, index): `plan_request` gives request i the
same prompt in every run, which is what lets a run with faults be compared to one without.
"""

from __future__ import annotations

import json
import random
import time
from dataclasses import dataclass

import httpx
from httpx_sse import EventSource

# (description, body or raw bytes): each must be refused with a 4xx and the OpenAI error shape.
BAD_BODIES: list[tuple[str, dict | bytes]] = [
    ("not json", b"\xff\xfe{not json"),
    ("json array", b"[1, 2, 3]"),
    ("negative temperature", {"prompt": "hi", "max_tokens": 4, "temperature": -1}),
    ("top_p above 1", {"prompt": "hi", "max_tokens": 4, "top_p": 1.5}),
    ("empty prompt", {"prompt": "", "max_tokens": 4}),
    ("max_tokens as a string", {"prompt": "hi", "max_tokens": "many"}),
    ("context overflow", {"prompt": [1] * 4, "max_tokens": 10_000_000}),
    ("token id out of vocabulary", {"prompt": [10**9], "max_tokens": 4}),
    ("unknown model", {"model": "no-such-model", "prompt": "hi", "max_tokens": 4}),
    ("n too large", {"prompt": "hi", "max_tokens": 4, "n": 10_000}),
]
RATE_LIMIT_HEADERS = ("retry-after", "x-ratelimit-limit-requests", "x-ratelimit-remaining-requests",
                      "x-ratelimit-reset-requests")


@dataclass(slots=True)
class Outcome:
    kind: str  # completed | cancelled | failed | lost | bad_rejected | bad_mishandled | over_quota
    error: str = ""
    e2e_seconds: float | None = None  # completed requests
    ttft_seconds: float | None = None  # completed streamed requests
    text: str | None = None  # the completion's text: all of it, or what came before a hang-up


@dataclass(slots=True)
class PlannedRequest:
    """One request of the soak, drawn before anything is sent (so every run sends the same)."""
    kind: str  # normal | bad | quota
    body: dict | None = None  # normal and quota requests
    cancel_early: bool = False  # hang up before the headers, after a random delay
    hang_up_after: int | None = None  # chunks, then close (streamed)
    cancel_delay: float = 0.0
    bad: tuple[str, dict | bytes] | None = None


def plan_request(index: int, args) -> PlannedRequest:
    """Request `index` of a soak with `args` (benchmarks/soak.py's flags); a function of
    (args.seed, index) only."""
    rng = random.Random(f"{args.seed}:{index}")
    if rng.random() < args.bad_fraction:
        return PlannedRequest("bad", bad=rng.choice(BAD_BODIES))
    quota = args.quota_api_key is not None and rng.random() < args.quota_fraction
    body = {"prompt": [rng.randrange(1, args.vocab_size) for _ in range(args.prompt_len)],
            "max_tokens": args.max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": rng.random() < args.stream_fraction}
    if body["stream"]:
        body["stream_options"] = {"include_usage": True}
    cancel = not quota and rng.random() < args.cancel_fraction
    early = cancel and (not body["stream"] or rng.random() < 0.5)  # hang up before the headers
    return PlannedRequest("quota" if quota else "normal", body, cancel_early=early,
                          hang_up_after=rng.randrange(0, args.max_tokens) if cancel and not early else None,
                          cancel_delay=rng.uniform(0.0, args.max_cancel_delay) if early else 0.0)


def openai_error_shaped(response: httpx.Response) -> bool:
    try:
        error = response.json().get("error")
    except (ValueError, AttributeError):
        return False
    return isinstance(error, dict) and {"message", "type", "param", "code"} <= error.keys()


async def bad_request(client: httpx.AsyncClient, url: str, headers: dict[str, str],
                      bad: tuple[str, dict | bytes]) -> Outcome:
    what, body = bad
    if isinstance(body, bytes):
        response = await client.post(url, content=body,
                                     headers={**headers, "content-type": "application/json"})
    else:
        response = await client.post(url, json=body, headers=headers)
    if 400 <= response.status_code < 500 and openai_error_shaped(response):
        return Outcome("bad_rejected")
    return Outcome("bad_mishandled", f"{what}: HTTP {response.status_code} {response.text[:160]!r}")


async def completion(client: httpx.AsyncClient, url: str, body: dict, headers: dict[str, str], *,
                     hang_up_after: int | None, quota: bool) -> Outcome:
    """One valid request, streamed or not (body["stream"]); `hang_up_after`: chunks, then close."""
    started = time.monotonic()
    first: float | None = None
    async with client.stream("POST", url, json=body, headers=headers) as response:
        if response.status_code != 200:
            text = (await response.aread())[:200]
            if quota and response.status_code == 429:
                missing = [h for h in RATE_LIMIT_HEADERS if h not in response.headers]
                if not missing and openai_error_shaped(response):
                    return Outcome("over_quota")
                return Outcome("failed", f"429 without {missing} or the error shape: {text!r}")
            return Outcome("failed", f"HTTP {response.status_code}: {text!r}")
        if not body["stream"]:
            reply = json.loads(await response.aread())
            tokens = reply.get("usage", {}).get("completion_tokens")
            if tokens != body["max_tokens"]:
                return Outcome("failed", f"non-streamed: {tokens} tokens")
            return Outcome("completed", e2e_seconds=time.monotonic() - started,
                           text=reply["choices"][0]["text"])
        tokens, finished, done, chunks, pieces = 0, False, False, 0, []
        async for sse in EventSource(response).aiter_sse():
            if sse.data == "[DONE]":
                done = True
                break
            chunks += 1
            if hang_up_after is not None and chunks > hang_up_after:
                # leaving the block closes the connection
                return Outcome("cancelled", text="".join(pieces))
            event = json.loads(sse.data)
            if "error" in event:
                return Outcome("failed", f"error chunk: {event['error']}")
            for choice in event.get("choices", []):
                if first is None and choice.get("text"):
                    first = time.monotonic()
                pieces.append(choice.get("text") or "")
                finished = finished or choice.get("finish_reason") is not None
            if event.get("usage"):
                tokens = event["usage"]["completion_tokens"]
    if not (done and finished):
        return Outcome("lost", f"incomplete: done={done} finished={finished} tokens={tokens}")
    if tokens != body["max_tokens"]:
        return Outcome("failed", f"streamed: {tokens} tokens")
    now = time.monotonic()
    return Outcome("completed", e2e_seconds=now - started,
                   ttft_seconds=None if first is None else first - started, text="".join(pieces))
