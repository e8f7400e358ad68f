"""The token buckets and the per-tenant limiter, on a hand-driven clock (no sleeps)."""

from __future__ import annotations

import pytest

from gateway.tenancy.rate_limit import (
    Admission,
    LimitSnapshot,
    TenantLimiter,
    TokenBucket,
    format_reset,
    rate_limit_headers,
    retry_after_header,
)
from gateway.tenancy.tenants import TenantLimits


def test_bucket_refills_continuously_up_to_its_capacity():
    bucket = TokenBucket(60, now=0.0)  # 60 per minute: 1 per second
    bucket.take(60, now=0.0)
    assert bucket.wait_s(1, now=0.0) == pytest.approx(1.0)
    assert bucket.wait_s(1, now=0.5) == pytest.approx(0.5)
    assert bucket.wait_s(1, now=1.0) == 0.0
    assert bucket.snapshot(now=1000.0) == LimitSnapshot(60, 60, 0.0)  # never above capacity


def test_bucket_debt_is_paid_off_by_the_refill():
    bucket = TokenBucket(60, now=0.0)
    bucket.take(90, now=0.0)  # usage above a reservation: charged
    assert bucket.snapshot(now=0.0).remaining == 0
    assert bucket.wait_s(1, now=0.0) == pytest.approx(31.0)
    assert bucket.snapshot(now=0.0).reset_s == pytest.approx(90.0)


def test_request_limit_refuses_then_admits_after_the_refill():
    limiter = TenantLimiter(TenantLimits(requests_per_minute=2), now=0.0)
    assert limiter.admit(10, now=0.0).admitted and limiter.admit(10, now=0.0).admitted
    refused = limiter.admit(10, now=0.0)
    assert (refused.admitted, refused.refused_by) == (False, "requests")
    assert refused.retry_after_s == pytest.approx(30.0)
    assert refused.requests == LimitSnapshot(2, 0, 60.0) and refused.tokens is None
    assert not limiter.admit(10, now=29.9).admitted
    assert limiter.admit(10, now=30.0).admitted
    assert limiter.in_flight == 3  # refusals take no slot


def test_token_limit_reserves_and_settles_the_unused_part():
    limiter = TenantLimiter(TenantLimits(tokens_per_minute=100), now=0.0)
    first = limiter.admit(60, now=0.0)
    assert first.admitted and first.tokens == LimitSnapshot(100, 40, 36.0)
    refused = limiter.admit(60, now=0.0)
    assert (refused.admitted, refused.refused_by) == (False, "tokens")
    assert refused.retry_after_s == pytest.approx(12.0)  # 20 tokens at 100/60 per second
    limiter.finish(reserved_tokens=60, used_tokens=15, now=0.0)  # 45 unused come back
    assert limiter.tokens.snapshot(now=0.0).remaining == 85
    assert limiter.admit(60, now=0.0).admitted


def test_a_refused_request_takes_nothing_from_either_bucket():
    limiter = TenantLimiter(TenantLimits(requests_per_minute=10, tokens_per_minute=100), now=0.0)
    assert not limiter.admit(101, now=0.0).admitted
    assert limiter.requests.snapshot(0.0).remaining == 10 and limiter.tokens.snapshot(0.0).remaining == 100
    assert limiter.too_large(101) and not limiter.too_large(100)


def test_concurrency_cap_counts_in_flight_requests():
    limiter = TenantLimiter(TenantLimits(max_concurrent_requests=2), now=0.0)
    assert limiter.admit(1, 0.0).admitted and limiter.admit(1, 0.0).admitted
    refused = limiter.admit(1, 0.0)
    assert (refused.admitted, refused.refused_by) == (False, "concurrency")
    limiter.finish(1, 1, 0.0)
    assert limiter.admit(1, 0.0).admitted


def test_no_limits_admit_everything_and_send_no_headers():
    limiter = TenantLimiter(TenantLimits(), now=0.0)
    admissions = [limiter.admit(10**9, now=0.0) for _ in range(1000)]
    assert all(a.admitted for a in admissions)
    assert rate_limit_headers(admissions[-1]) == []


def test_openai_headers_and_durations():
    admission = Admission(True, requests=LimitSnapshot(60, 59, 1.0), tokens=LimitSnapshot(1000, 10, 59.4))
    assert dict(rate_limit_headers(admission)) == {
        "x-ratelimit-limit-requests": "60", "x-ratelimit-remaining-requests": "59",
        "x-ratelimit-reset-requests": "1s", "x-ratelimit-limit-tokens": "1000",
        "x-ratelimit-remaining-tokens": "10", "x-ratelimit-reset-tokens": "59.4s"}
    assert [format_reset(s) for s in (0.0, 0.0171, 1.5, 119.7, 360)] == ["0ms", "18ms", "1.5s", "2m0s", "6m0s"]
    assert [retry_after_header(s) for s in (0.0, 0.2, 1.0, 29.01)] == ["1", "1", "1", "30"]
