"""Serving a request on its route's pools in turn: the requested model's, then its fallback's.

Both APIs hand `first_answer` a `start(pool, attempt)` that prepares the request *for that pool*
(its tokenizer, vocabulary and context length: a fallback model is another model) and starts it.
A refusal before the first step — RESOURCE_EXHAUSTED (the pool is shedding: every replica's queue
is full) or UNAVAILABLE (every replica is down) — moves the request to the next pool; once a step
has arrived the answer stays where it is. The tenant's lease admits the request once (`AdmitOnce`):
a fallback attempt keeps that admission and its prefix-cache salt.
"""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import grpc

from gateway import metrics
from gateway.errors import UpstreamError
from gateway.upstream.model_pools import ModelPool, Route
from pagoda.runtime.logging import get_logger

log = get_logger(__name__)
T = TypeVar("T")
Context = TypeVar("Context")
FALLBACK_REASONS = {grpc.StatusCode.RESOURCE_EXHAUSTED: "shedding", grpc.StatusCode.UNAVAILABLE: "unavailable"}


@dataclass(slots=True)
class Answer(Generic[T, Context]):
    pool: ModelPool  # the pool that answered: its name is the response's `model`
    first: T  # the first step
    steps: AsyncIterator[T]  # the rest
    context: Context  # what `start` prepared for that pool (the request, its tokenizer...)


async def first_answer(route: Route, start: Callable[[ModelPool, int], Awaitable[tuple[AsyncIterator[T], Context]]],
                       wait: Callable[[Awaitable[T]], Awaitable[T]] | None = None) -> Answer[T, Context]:
    """The first step from the first pool of `route` that does not refuse the request.
    `wait` wraps each wait for a first step (HTTP: cancel it when the client goes away)."""
    reason = None if route.pools[0] is route.requested else "unavailable"  # skipped up front
    for attempt, pool in enumerate(route.pools):
        steps, context = await start(pool, attempt)
        try:
            first = await (wait(anext(steps)) if wait is not None else anext(steps))
        except UpstreamError as error:
            await steps.aclose()
            reason = FALLBACK_REASONS.get(error.grpc_code)
            if reason is None or attempt + 1 == len(route.pools):
                raise
            log.info("model_fallback", requested_model=route.requested.name, refused_by=pool.name,
                     next_model=route.pools[attempt + 1].name, reason=reason)
            continue
        if pool is not route.requested:
            metrics.FALLBACK_REQUESTS.labels(route.requested.name, pool.name, reason).inc()
        return Answer(pool, first, steps, context)
    raise AssertionError("a route has at least one pool")


class AdmitOnce:
    """A tenant's lease admits one request: the first attempt is admitted (its tokens reserved), a
    fallback attempt reuses that admission with its cache salt (the tenant is then charged what the
    answering model used). `admit(request, max_model_len) -> (salted request, lease)`."""

    def __init__(self, admit: Callable[[Any, int], tuple[Any, Any]]) -> None:
        self._admit = admit
        self._admitted: tuple[Any, Any] | None = None

    def __call__(self, request: Any, max_model_len: int) -> tuple[Any, Any]:
        if self._admitted is None:
            self._admitted = self._admit(request, max_model_len)
            return self._admitted
        salted, lease = self._admitted
        return dataclasses.replace(request, cache_salt=salted.cache_salt, tenant=salted.tenant,
                                   kv_share=salted.kv_share), lease


async def prepend(first: T, rest: AsyncIterator[T]) -> AsyncIterator[T]:
    """`first`, then `rest`; closing this closes `rest` (which cancels the upstream call)."""
    try:
        yield first
        async for item in rest:
            yield item
    finally:
        await rest.aclose()
