"""Tenancy over real worker + scheduler + gateway processes, with the real `openai` client:
the prefix cache is salted per tenant (no tenant ever gets another's cached tokens, unless the key
file gives them a shared salt), limits answer 429 with OpenAI's headers, and a bad key file stops
the gateway at startup naming the line and field."""

from __future__ import annotations

import json
import subprocess
import sys
import uuid

import httpx
import openai
import pytest

from tests.e2e.conftest import REPO
from tests.e2e.gateway_conftest import start_gateway

pytestmark = pytest.mark.slow
KEYS = [
    {"key": "sk-alpha", "tenant": "alpha"},
    {"key": "sk-beta", "tenant": "beta"},
    {"key": "sk-gamma", "tenant": "gamma", "cache_salt": "shared-gd"},
    {"key": "sk-delta", "tenant": "delta", "cache_salt": "shared-gd"},
    {"key": "sk-slow", "tenant": "slow", "requests_per_minute": 1},
]


@pytest.fixture(scope="module")
def tenant_gateway(engine_processes, tmp_path_factory):
    logs = tmp_path_factory.mktemp("tenancy")
    keys = logs / "keys.jsonl"
    keys.write_text("".join(json.dumps(entry) + "\n" for entry in KEYS))
    gateway, http_url = start_gateway(engine_processes.scheduler_target, logs, "--api-keys", str(keys))
    try:
        yield http_url
    finally:
        gateway.stop()


def client(http_url: str, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{http_url}/v1", api_key=key, max_retries=0)


def cached_tokens(http_url: str, key: str, prompt: str) -> int:
    reply = client(http_url, key).completions.create(model="", prompt=prompt, max_tokens=2, temperature=0)
    assert reply.usage.prompt_tokens >= 64, reply.usage  # several full 16-token blocks
    return reply.usage.prompt_tokens_details.cached_tokens


def long_prompt() -> str:
    """About 100 tokens no other test sends (so nothing else could have cached it)."""
    nonce = uuid.uuid4().hex
    return " ".join(f"{nonce[i % 32]}{word}" for i, word in enumerate(
        "the quiet river bends past the old mill and the stone bridge where children wait".split() * 6))


def test_prefix_cache_is_per_tenant(tenant_gateway):
    prompt = long_prompt()
    assert cached_tokens(tenant_gateway, "sk-alpha", prompt) == 0  # cold
    assert cached_tokens(tenant_gateway, "sk-alpha", prompt) > 0  # within a tenant: a hit
    assert cached_tokens(tenant_gateway, "sk-beta", prompt) == 0  # across tenants: never
    assert cached_tokens(tenant_gateway, "sk-beta", prompt) > 0


def test_tenants_with_a_shared_salt_share_the_prefix_cache(tenant_gateway):
    prompt = long_prompt()
    assert cached_tokens(tenant_gateway, "sk-gamma", prompt) == 0
    assert cached_tokens(tenant_gateway, "sk-delta", prompt) > 0
    assert cached_tokens(tenant_gateway, "sk-alpha", prompt) == 0


def test_request_limit_answers_429_with_openai_headers(tenant_gateway):
    slow = client(tenant_gateway, "sk-slow")
    first = slow.completions.with_raw_response.create(model="", prompt="Hi", max_tokens=2)
    assert first.headers["x-ratelimit-limit-requests"] == "1"
    assert first.headers["x-ratelimit-remaining-requests"] == "0"
    with pytest.raises(openai.RateLimitError) as refused:
        slow.completions.create(model="", prompt="Hi", max_tokens=2)
    assert int(refused.value.response.headers["retry-after"]) >= 50
    assert refused.value.response.headers["x-ratelimit-reset-requests"].endswith("s")
    assert client(tenant_gateway, "sk-alpha").completions.create(model="", prompt="Hi", max_tokens=2)
    with pytest.raises(openai.AuthenticationError):
        client(tenant_gateway, "sk-nobody").completions.create(model="", prompt="Hi", max_tokens=2)
    scrape = httpx.get(f"{tenant_gateway}/metrics").text
    assert 'pagoda:tenant_rate_limited_total{limit="requests",tenant="slow"} 1.0' in scrape
    assert 'pagoda:tenant_requests_total{tenant="beta"}' in scrape


def test_a_bad_key_file_stops_the_gateway_naming_line_and_field(tmp_path):
    keys = tmp_path / "keys.jsonl"
    keys.write_text('{"key": "k1", "tenant": "a"}\n{"key": "k2", "tenant": "b", "tokens_per_minute": "lots"}\n')
    result = subprocess.run([sys.executable, "-m", "gateway", "--api-keys", str(keys)], cwd=REPO,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert f"{keys} line 2: field 'tokens_per_minute' must be a positive integer" in result.stderr
