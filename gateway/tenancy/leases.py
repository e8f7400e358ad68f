"""Tenancy at run time: which tenant an API key names, and each request's lease on its limits.

Both APIs do the same (the HTTP side's glue is gateway/openai/middleware.py, the gRPC side's
gateway/grpc_api.py): `authenticate` the key (None: 401 / UNAUTHENTICATED), open a `Lease`,
`admit` the tokenized request through it (429 / RESOURCE_EXHAUSTED when over a limit), let
`generate()` `record` the tokens used as they stream, and `close` the lease whatever happened
(finished, cancelled, failed): the concurrency slot is freed and the token reservation settled.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from gateway import metrics
from gateway.errors import RateLimitedError
from gateway.tenancy.rate_limit import Admission, TenantLimiter, format_reset, rate_limit_headers
from gateway.tenancy.tenants import ANONYMOUS, Tenant, TenantTable, key_digest
from pagoda.contract.errors import InvalidRequestError
from pagoda.runtime.logging import get_logger

if TYPE_CHECKING:
    from gateway.generation import GenerationInput

log = get_logger(__name__)


class Tenancy:
    def __init__(self, table: TenantTable, clock: Callable[[], float] = time.monotonic) -> None:
        self.table = table
        self.clock = clock
        self._names_by_digest = dict(table.keys)
        tenants = table.tenants if table.auth_required else (ANONYMOUS,)
        self._tenants = {t.name: t for t in tenants}
        self._limiters = {t.name: TenantLimiter(t.limits, clock()) for t in tenants}
        for name in self._tenants:  # every series exists from the start
            metrics.TENANT_REQUESTS.labels(tenant=name)
            metrics.TENANT_TOKENS.labels(tenant=name)
            metrics.TENANT_IN_FLIGHT.labels(tenant=name)

    def authenticate(self, token: str | None) -> Tenant | None:
        """The tenant `token` (the bearer key) belongs to; None when a key is required and this is
        not one. With no keys configured every request is the anonymous tenant."""
        if not self.table.auth_required:
            return ANONYMOUS
        name = self._names_by_digest.get(key_digest(token)) if token else None
        return self._tenants[name] if name is not None else None

    def lease(self, tenant: Tenant) -> Lease:
        return Lease(self, tenant, self._limiters[tenant.name])


class Lease:
    """One request's hold on its tenant's limits. `close()` is idempotent and safe before `admit`."""

    def __init__(self, tenancy: Tenancy, tenant: Tenant, limiter: TenantLimiter) -> None:
        self.tenant = tenant
        self._tenancy, self._limiter = tenancy, limiter
        self.admission: Admission | None = None
        self.reserved_tokens = 0
        self.used_tokens = 0
        self._open = False

    def admit(self, request: GenerationInput, max_model_len: int) -> GenerationInput:
        """Reserve prompt + n × max_tokens (max_tokens unset: what the context leaves), or raise
        RateLimitedError. Returns `request` with the tenant's prefix-cache salt."""
        assert self.admission is None, "a lease admits one request"
        num_prompt = len(request.prompt_token_ids)
        sampling = request.sampling
        max_new = sampling.max_tokens if sampling.max_tokens is not None else max_model_len - num_prompt
        reserved = num_prompt + sampling.n * max(0, max_new)
        if self._limiter.too_large(reserved):
            raise InvalidRequestError(
                f"this request needs {reserved} tokens (prompt + n × max_tokens), more than tenant "
                f"{self.tenant.name!r}'s limit of {self._limiter.limits.tokens_per_minute} tokens per "
                "minute: lower max_tokens")
        name = self.tenant.name
        self.admission = admission = self._limiter.admit(reserved, self._tenancy.clock())
        if not admission.admitted:
            metrics.TENANT_RATE_LIMITED.labels(tenant=name, limit=admission.refused_by).inc()
            log.info("tenant_rate_limited", tenant=name, limit=admission.refused_by,
                     reserved_tokens=reserved, retry_after_s=round(admission.retry_after_s, 3))
            raise RateLimitedError(self._refusal(reserved), admission.retry_after_s)
        self._open = True
        self.reserved_tokens = reserved
        self.used_tokens = num_prompt  # the engine prefills it once it has the request
        metrics.TENANT_REQUESTS.labels(tenant=name).inc()
        metrics.TENANT_IN_FLIGHT.labels(tenant=name).inc()
        tenant = self.tenant
        return dataclasses.replace(request, cache_salt=tenant.prefix_cache_salt(request.cache_salt),
                                   tenant=tenant.upstream_name, kv_share=tenant.kv_share or 0.0)

    def record(self, used_tokens: int) -> None:
        """Tokens this request has cost so far (prompt + generated); 0 if the engine refused it."""
        self.used_tokens = used_tokens

    def close(self) -> None:
        if not self._open:
            return
        self._open = False
        self._limiter.finish(self.reserved_tokens, self.used_tokens, self._tenancy.clock())
        metrics.TENANT_TOKENS.labels(tenant=self.tenant.name).inc(self.used_tokens)
        metrics.TENANT_IN_FLIGHT.labels(tenant=self.tenant.name).dec()

    def headers(self) -> list[tuple[str, str]]:
        """OpenAI's x-ratelimit-* headers as of admission (none before, or without limits)."""
        return rate_limit_headers(self.admission) if self.admission is not None else []

    def _refusal(self, reserved: int) -> str:
        admission, limits, name = self.admission, self._limiter.limits, self.tenant.name
        assert admission is not None
        if admission.refused_by == "concurrency":
            return (f"Too many concurrent requests for tenant {name!r}: limit "
                    f"{limits.max_concurrent_requests}. Retry when one of them has finished.")
        snapshot = admission.requests if admission.refused_by == "requests" else admission.tokens
        assert snapshot is not None
        requested = 1 if admission.refused_by == "requests" else reserved
        return (f"Rate limit reached for tenant {name!r} on {admission.refused_by} per minute: "
                f"limit {snapshot.limit}, remaining {snapshot.remaining}, requested {requested}. "
                f"Please try again in {format_reset(admission.retry_after_s)}.")
