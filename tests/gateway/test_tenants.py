"""The --api-keys file: parsing, clear errors naming the line and field, the tenant table."""

from __future__ import annotations

import pytest

from gateway.__main__ import parse_args
from gateway.tenancy.tenants import (
    DEFAULT_TENANT,
    Tenant,
    TenantFileError,
    TenantLimits,
    key_digest,
    load_tenant_file,
    parse_tenant_lines,
    tenant_table,
)

GOOD = """
# team a has two keys (a rotation); its limits are set once
{"key": "sk-a-1", "tenant": "team-a", "requests_per_minute": 60, "tokens_per_minute": 5000, "max_concurrent_requests": 4}
{"key": "sk-a-2", "tenant": "team-a"}

{"key": "sk-b", "tenant": "team-b", "cache_salt": "shared", "tokens_per_minute": null}
{"key": "sk-c", "tenant": "team-c", "cache_salt": "shared", "kv_share": 0.5}
"""


def test_parses_keys_tenants_limits_and_salts():
    table = parse_tenant_lines(GOOD, "keys.jsonl")
    assert dict(table.keys) == {key_digest("sk-a-1"): "team-a", key_digest("sk-a-2"): "team-a",
                                key_digest("sk-b"): "team-b", key_digest("sk-c"): "team-c"}
    assert table.tenant("team-a") == Tenant("team-a", TenantLimits(60, 5000, 4))
    assert table.tenant("team-b") == Tenant("team-b", TenantLimits(), "shared")
    assert table.tenant("team-c").kv_share == 0.5 and table.tenant("team-b").kv_share is None
    assert table.auth_required


def test_prefix_cache_salt_defaults_to_the_tenant_and_keeps_tenants_apart():
    table = parse_tenant_lines(GOOD)
    a, b, c = (table.tenant(name) for name in ("team-a", "team-b", "team-c"))
    assert a.prefix_cache_salt() == "team-a"
    assert b.prefix_cache_salt() == c.prefix_cache_salt() == "shared"  # configured to share
    assert a.prefix_cache_salt("x") == "team-a:x"
    # no request salt lets one tenant reach another's salt: tenant salts contain no ':'
    assert a.prefix_cache_salt("shared") != "shared" and a.prefix_cache_salt("") != "team-b"
    assert Tenant("anonymous", cache_salt="").prefix_cache_salt("s") == "s"


@pytest.mark.parametrize(("text", "message"), [
    ('{"key": "k"', "line 1: not a JSON object"),
    ('["k", "t"]', "line 1: not a JSON object"),
    ('{"key": "k", "tenant": "t", "rpm": 5}', "line 1: unknown field 'rpm'"),
    ('{"tenant": "t"}', "line 1: field 'key' must be a non-empty string"),
    ('{"key": "a b", "tenant": "t"}', "line 1: field 'key' must be a non-empty string without spaces"),
    ('{"key": "k"}', "line 1: field 'tenant' must be 1-64 characters"),
    ('{"key": "k", "tenant": "a:b"}', "line 1: field 'tenant' must be 1-64 characters"),
    ('{"key": "k", "tenant": "t", "cache_salt": ""}', "line 1: field 'cache_salt' must be 1-64"),
    ('{"key": "k", "tenant": "t", "tokens_per_minute": 0}', "line 1: field 'tokens_per_minute' must be a positive"),
    ('{"key": "k", "tenant": "t", "requests_per_minute": true}', "field 'requests_per_minute' must be"),
    ('{"key": "k", "tenant": "t", "max_concurrent_requests": 1.5}', "field 'max_concurrent_requests' must be"),
    ('{"key": "k", "tenant": "t", "kv_share": 0}', "field 'kv_share' must be a number in (0, 1]"),
    ('{"key": "k", "tenant": "t", "kv_share": 1.5}', "field 'kv_share' must be a number in (0, 1]"),
    ('{"key": "k", "tenant": "t"}\n\n{"key": "k", "tenant": "u"}', "line 3: field 'key': the same key is listed twice"),
    ('{"key": "k1", "tenant": "t", "requests_per_minute": 5}\n{"key": "k2", "tenant": "t", "requests_per_minute": 6}',
     "line 2: field 'requests_per_minute': tenant 't' already has 5"),
    ("# only a comment\n", "no API keys"),
])
def test_bad_lines_name_the_line_and_the_field(text, message):
    with pytest.raises(TenantFileError, match="^keys.jsonl") as error:
        parse_tenant_lines(text, "keys.jsonl")
    assert message in str(error.value)


def test_the_single_api_key_joins_as_tenant_default():
    table = tenant_table("solo", parse_tenant_lines(GOOD))
    assert dict(table.keys)[key_digest("solo")] == DEFAULT_TENANT
    assert table.tenant(DEFAULT_TENANT) == Tenant(DEFAULT_TENANT)
    assert not tenant_table(None, None).auth_required
    with pytest.raises(TenantFileError, match="--api-key is also listed"):
        tenant_table("sk-b", parse_tenant_lines(GOOD))


def test_command_line_loads_the_file_or_exits_naming_the_line(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("PAGODA_API_KEY", raising=False)
    good = tmp_path / "keys.jsonl"
    good.write_text(GOOD)
    config = parse_args(["--api-keys", str(good)])
    assert config.tenant_table().tenant("team-a").limits.max_concurrent_requests == 4
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"key": "k", "tenant": "t"}\n{"key": "k2", "tenant": "t", "tokens_per_minute": -1}\n')
    with pytest.raises(SystemExit) as exit_info:
        parse_args(["--api-keys", str(bad)])
    assert exit_info.value.code == 2
    assert f"{bad} line 2: field 'tokens_per_minute' must be a positive integer" in capsys.readouterr().err
    with pytest.raises(TenantFileError, match="cannot read"):
        load_tenant_file(tmp_path / "missing.jsonl")
