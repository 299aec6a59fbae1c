"""Tenants: API keys -> tenant ids, and each tenant's `cache_salt` (HMAC of its id under a router secret).

The `--api-keys` file is either JSON, an object `{"<key>": "<tenant>", ...}` or a list of
`{"key": ..., "tenant": ...}` records, or text with one `<key> <tenant>` pair a line (`#`
starts a comment; blank lines are skipped). Several keys may name one tenant. Keys are kept
only as SHA-256 digests; a presented key is hashed and its digest compared in constant time
(`hmac.compare_digest`). The salt is `HMAC-SHA256(secret, tenant id)` in hex: 64 characters,
valid for vLLM (at most 128, none of `@ / \\` or NUL), stable while the secret is.

A key whose tenant is `@admin` is not a tenant: it opens `/metrics` and `/debug/index` (which
show every tenant's traffic) and nothing else; it cannot send generation requests.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import os
import secrets
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from agentkv.errors import UserError

log = logging.getLogger("agentkv.route")

SECRET_ENV = "AGENTKV_ROUTER_SECRET"
ADMIN = "@admin"  # the tenant name that marks an admin key


@dataclass(frozen=True, slots=True)
class Tenant:
    """A tenant as the router sees it: its id and the cache_salt injected into its requests."""

    id: str
    salt: str | None


def tenant_salt(secret: bytes, tenant_id: str) -> str:
    """`HMAC-SHA256(secret, tenant id)` as 64 hex characters: the tenant's vLLM cache_salt."""
    return hmac.new(secret, tenant_id.encode("utf-8"), hashlib.sha256).hexdigest()


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode("utf-8")).digest()


def _read_text(p: Path, flag: str) -> str:
    """A flag's file as UTF-8 text; UserError naming the flag and file when it cannot be read."""
    try:
        return p.read_text(encoding="utf-8")
    except OSError as e:
        raise UserError(f"{flag} {p}: cannot read: {e.strerror or e}") from None
    except UnicodeDecodeError:
        raise UserError(f"{flag} {p}: not UTF-8 text") from None


def parse_api_keys(path: str | Path) -> dict[str, str]:
    """Read an --api-keys file into {key: tenant}; UserError naming the file and line on bad input."""
    p = Path(path)
    text = _read_text(p, "--api-keys")
    stripped = text.lstrip()
    pairs: list[tuple[str, object, object]] = []  # (where, key, tenant)
    if stripped[:1] in ("{", "["):
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise UserError(f"--api-keys {p}: invalid JSON at line {e.lineno}: {e.msg}") from None
        if isinstance(data, dict):
            pairs = [(f"key #{i + 1}", k, v) for i, (k, v) in enumerate(data.items())]
        else:
            for i, rec in enumerate(data):
                if not isinstance(rec, dict) or "key" not in rec or "tenant" not in rec:
                    raise UserError(
                        f"--api-keys {p}: record {i + 1}: expected an object with 'key' and 'tenant'"
                    )
                pairs.append((f"record {i + 1}", rec["key"], rec["tenant"]))
    else:
        for n, line in enumerate(text.splitlines(), 1):
            line = line.split("#", 1)[0].strip()
            if not line:
                continue
            parts = line.split()
            if len(parts) != 2:
                raise UserError(
                    f"--api-keys {p}: line {n}: expected '<key> <tenant>', got {len(parts)} fields"
                )
            pairs.append((f"line {n}", parts[0], parts[1]))
    keys: dict[str, str] = {}
    for where, key, tenant in pairs:
        if not isinstance(key, str) or not key or not isinstance(tenant, str) or not tenant:
            raise UserError(f"--api-keys {p}: {where}: key and tenant must be non-empty strings")
        if key in keys:
            raise UserError(f"--api-keys {p}: {where}: duplicate key (for tenant '{tenant}')")
        keys[key] = tenant
    if not keys:
        raise UserError(f"--api-keys {p}: no keys in the file")
    return keys


def read_secret_file(path: str | Path) -> str:
    """The router secret from a file (its first line, surrounding whitespace stripped)."""
    p = Path(path)
    text = _read_text(p, "--router-secret-file")
    lines = text.strip().splitlines()
    if not lines or not lines[0].strip():
        raise UserError(f"--router-secret-file {p}: the file is empty")
    return lines[0].strip()


def router_secret(value: str | None = None) -> bytes:
    """The HMAC secret: `value`, else $AGENTKV_ROUTER_SECRET, else random (salts change on restart)."""
    value = value if value is not None else os.environ.get(SECRET_ENV)
    if value:
        return value.encode("utf-8")
    log.warning(
        "no router secret given (--router-secret or $%s): using a random one, so tenant "
        "cache salts, and the engines' cached prefixes they key, do not survive a router restart",
        SECRET_ENV,
    )
    return secrets.token_bytes(32)


class Tenants:
    """Authenticates requests by API key and hands out each tenant's salt; open when no keys are set."""

    def __init__(self, keys: Mapping[str, str] | None, secret: bytes) -> None:
        self._by_digest: dict[bytes, tuple[bytes, Tenant]] = {}  # digest[:8] -> (digest, tenant)
        self._admins: dict[bytes, bytes] = {}  # digest[:8] -> digest, for ADMIN keys
        self._tenants: dict[str, Tenant] = {}
        for key, tid in (keys or {}).items():
            if tid == ADMIN:
                d = _digest(key)
                self._admins[d[:8]] = d
                continue
            t = self._tenants.get(tid)
            if t is None:
                t = self._tenants[tid] = Tenant(tid, tenant_salt(secret, tid))
            d = _digest(key)
            self._by_digest[d[:8]] = (d, t)
        self.open = not keys

    @classmethod
    def from_file(cls, path: str | Path | None, secret: bytes) -> Tenants:
        return cls(parse_api_keys(path) if path else None, secret)

    def authenticate(self, headers: Mapping[str, str]) -> Tenant | None:
        """The tenant of `Authorization: Bearer <key>` (or `x-api-key`); None if missing or wrong.

        With no keys configured every request is the anonymous tenant with no salt injected.
        """
        if self.open:
            return ANONYMOUS
        d = _presented(headers)
        if d is None:
            return None
        # look up by the digest's first 8 bytes (timing there says nothing about the key's bytes),
        # then compare the full stored digest in constant time; a miss compares against a dummy
        stored, t = self._by_digest.get(d[:8], _MISS)
        return t if hmac.compare_digest(stored, d) else None

    def admin(self, headers: Mapping[str, str]) -> bool | None:
        """True for an admin key (or no keys configured), False for a tenant's key, None for none or a
        wrong one: what `/metrics` and `/debug/index` ask."""
        if self.open:
            return True
        d = _presented(headers)
        if d is None:
            return None
        if hmac.compare_digest(self._admins.get(d[:8], _MISS[0]), d):
            return True
        return False if self.authenticate(headers) is not None else None

    @property
    def admins(self) -> int:
        return len(self._admins)

    def salts(self) -> dict[str, str]:
        """{salt: tenant id} for every configured tenant (lets the index attribute salted events)."""
        return {t.salt: t.id for t in self._tenants.values() if t.salt}

    def __len__(self) -> int:
        return len(self._tenants)


def _presented(headers: Mapping[str, str]) -> bytes | None:
    """SHA-256 of the key in `Authorization: Bearer <key>` or `x-api-key`; None when there is none."""
    auth = headers.get("Authorization") or headers.get("authorization") or ""
    key = auth[7:].strip() if auth[:7].lower() == "bearer " else headers.get("x-api-key", "")
    return _digest(key) if key else None


ANONYMOUS = Tenant("", None)
_MISS: tuple[bytes, Tenant | None] = (bytes(32), None)


class InFlight:
    """Requests in flight per tenant, at most `limit` of one tenant at once (0: no limit)."""

    __slots__ = ("limit", "n")

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.n: dict[str, int] = {}

    def take(self, tenant: str) -> bool:
        """Count one more of `tenant`'s requests in flight; False (nothing counted) past the limit."""
        if not self.limit:
            return True
        n = self.n.get(tenant, 0)
        if n >= self.limit:
            return False
        self.n[tenant] = n + 1
        return True

    def give(self, tenant: str) -> None:
        """One of `tenant`'s requests is done (after a `take` that returned True)."""
        if self.limit:
            n = self.n[tenant] - 1
            if n:
                self.n[tenant] = n
            else:
                del self.n[tenant]
