"""Tenants and their API keys: the `--api-keys FILE` format, parsed into one immutable table. Pure.

The file is JSON Lines: one object per line, one line per API key; blank lines and lines starting
with `#` are skipped.

    {"key": "sk-a-1", "tenant": "team-a", "requests_per_minute": 600, "max_concurrent_requests": 8}
    {"key": "sk-a-2", "tenant": "team-a"}
    {"key": "sk-b", "tenant": "team-b", "cache_salt": "shared-ab", "kv_share": 0.25}

`key` and `tenant` are required. The limits, `cache_salt` and `kv_share` (the fraction of each
scheduler's device KV pool the tenant may hold, docs/kv_tiers.md#per-tenant-kv-budgets; default the
scheduler's --tenant-kv-share) belong to the tenant: a tenant named
on several lines (several keys, e.g. during a rotation) takes them from whichever line sets them,
and two lines that set the same one differently are an error. A missing limit is no limit. The
prefix-cache salt defaults to the tenant's name, so tenants never share cached blocks; tenants that
set the same `cache_salt` share theirs.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass, field
from pathlib import Path

LIMIT_FIELDS = ("requests_per_minute", "tokens_per_minute", "max_concurrent_requests")
_FIELDS = frozenset({"key", "tenant", "cache_salt", "kv_share", *LIMIT_FIELDS})
# Tenant names are Prometheus label values and salts: short, no ':' (see `prefix_cache_salt`).
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
DEFAULT_TENANT = "default"  # the tenant of the single `--api-key`
ANONYMOUS_TENANT = "anonymous"  # every request when no key is configured


class TenantFileError(ValueError):
    """A bad `--api-keys` file; the message names the file, the line and the field."""


@dataclass(frozen=True, slots=True)
class TenantLimits:
    requests_per_minute: int | None = None
    tokens_per_minute: int | None = None
    """Prompt tokens + max_tokens are reserved at admission, the unused part given back at the end."""
    max_concurrent_requests: int | None = None


@dataclass(frozen=True, slots=True)
class Tenant:
    name: str
    limits: TenantLimits = field(default_factory=TenantLimits)
    cache_salt: str | None = None
    """Prefix-cache salt; None: the tenant's name. "" (the anonymous tenant only): no salt."""
    kv_share: float | None = None
    """Its KV cap in each scheduler, a fraction of the pool; None: the scheduler's default."""

    @property
    def upstream_name(self) -> str:
        """The tenant as the scheduler knows it: "" for the anonymous one."""
        return "" if self == ANONYMOUS else self.name

    def prefix_cache_salt(self, request_salt: str = "") -> str:
        """The salt sent upstream: the tenant's, then the request's own `cache_salt` after a ':'.
        Tenant salts never contain ':', so no request salt can reproduce another tenant's."""
        salt = self.name if self.cache_salt is None else self.cache_salt
        if not salt:
            return request_salt
        return f"{salt}:{request_salt}" if request_salt else salt


ANONYMOUS = Tenant(ANONYMOUS_TENANT, cache_salt="")


def key_digest(key: str) -> bytes:
    """Keys are looked up by SHA-256 digest: the lookup's timing says nothing about a key's bytes."""
    return hashlib.sha256(key.encode()).digest()


@dataclass(frozen=True, slots=True)
class TenantTable:
    """API key digests -> tenant names, and the tenants. No keys: auth is off (ANONYMOUS)."""

    keys: tuple[tuple[bytes, str], ...] = ()
    tenants: tuple[Tenant, ...] = ()

    @property
    def auth_required(self) -> bool:
        return bool(self.keys)

    def tenant(self, name: str) -> Tenant:
        return next(t for t in self.tenants if t.name == name)


def load_tenant_file(path: str | Path) -> TenantTable:
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as error:
        raise TenantFileError(f"{path}: cannot read the API key file: {error}") from None
    return parse_tenant_lines(text, str(path))


def parse_tenant_lines(text: str, source: str = "api keys") -> TenantTable:
    keys: dict[bytes, str] = {}
    settings: dict[str, dict[str, object]] = {}  # tenant -> field -> value, first line that set it
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        where = f"{source} line {number}"
        entry = _parse_line(line, where)
        digest = key_digest(entry["key"])
        if digest in keys:
            raise TenantFileError(f"{where}: field 'key': the same key is listed twice")
        keys[digest] = name = entry["tenant"]
        known = settings.setdefault(name, {})
        for name_of_field in ("cache_salt", "kv_share", *LIMIT_FIELDS):
            if name_of_field not in entry or entry[name_of_field] is None:
                continue
            if known.setdefault(name_of_field, entry[name_of_field]) != entry[name_of_field]:
                raise TenantFileError(f"{where}: field '{name_of_field}': tenant {name!r} already has "
                                      f"{known[name_of_field]!r} from an earlier line")
    if not keys:
        raise TenantFileError(f"{source}: no API keys (one JSON object per line)")
    tenants = tuple(Tenant(name, TenantLimits(**{f: v for f, v in known.items() if f in LIMIT_FIELDS}),
                           known.get("cache_salt"), known.get("kv_share"))  # type: ignore[arg-type]
                    for name, known in settings.items())
    return TenantTable(tuple(keys.items()), tenants)


def _parse_line(line: str, where: str) -> dict:
    try:
        entry = json.loads(line)
    except json.JSONDecodeError as error:
        raise TenantFileError(f"{where}: not a JSON object: {error.msg}") from None
    if not isinstance(entry, dict):
        raise TenantFileError(f"{where}: not a JSON object")
    unknown = sorted(set(entry) - _FIELDS)
    if unknown:
        known = ", ".join(sorted(_FIELDS))
        raise TenantFileError(f"{where}: unknown field {unknown[0]!r} (known: {known})")
    key = entry.get("key")
    if not isinstance(key, str) or not key or any(c.isspace() for c in key):
        raise TenantFileError(f"{where}: field 'key' must be a non-empty string without spaces")
    for name in ("tenant", "cache_salt"):
        value = entry.get(name)
        valid = isinstance(value, str) and _NAME.fullmatch(value)
        if (name == "tenant" or value is not None) and not valid:
            raise TenantFileError(f"{where}: field {name!r} must be 1-64 characters of A-Z a-z 0-9 . _ - "
                                  f"(starting with a letter or digit), got {value!r}")
    share = entry.get("kv_share")
    if share is not None and (isinstance(share, bool) or not isinstance(share, (int, float))
                              or not 0 < share <= 1):
        raise TenantFileError(f"{where}: field 'kv_share' must be a number in (0, 1] or null, got {share!r}")
    for name in LIMIT_FIELDS:
        value = entry.get(name)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise TenantFileError(f"{where}: field {name!r} must be a positive integer or null, "
                                  f"got {value!r}")
    return entry


def tenant_table(api_key: str | None, file_table: TenantTable | None) -> TenantTable:
    """The gateway's table: the file's tenants, plus the single `--api-key` as tenant "default"
    (joining a file tenant of that name). Neither: auth off, every request is ANONYMOUS."""
    table = file_table or TenantTable()
    if api_key is None:
        return table
    digest = key_digest(api_key)
    if any(d == digest for d, _ in table.keys):
        raise TenantFileError("--api-key is also listed in the --api-keys file")
    tenants = table.tenants
    if all(t.name != DEFAULT_TENANT for t in tenants):
        tenants = (*tenants, Tenant(DEFAULT_TENANT))
    return TenantTable(((digest, DEFAULT_TENANT), *table.keys), tenants)
