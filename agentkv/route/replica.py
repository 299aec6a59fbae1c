"""Placement that agrees across router replicas (several `agentkv route` processes over one set of
workers, behind a load balancer or `--processes N`).

Every replica subscribes to every worker's events, so their indexes, and kv_aware's cache terms,
converge. What each replica holds alone is its own tie-break counter and its own in-flight load,
so among workers that cost the same, a session's request goes where a keyed hash of its session
id points (the same on every replica given the same `--router-secret-file`), not where a
per-process counter happens to stand. Requests without a session still rotate.
"""

from __future__ import annotations

import hashlib
import os

from agentkv.placement.policy import KvAware
from agentkv.route.tenants import SECRET_ENV


def tie_key(secret: str | None) -> bytes:
    """The key of the session tie-break: from the router secret (replicas share it), else fixed."""
    value = secret if secret is not None else os.environ.get(SECRET_ENV, "")
    return hashlib.sha256(b"agentkv-route-tie\x1f" + value.encode("utf-8")).digest()


def session_rank(key: bytes, session: str) -> int:
    """A 64-bit keyed hash of a session id (BLAKE2b): where its ties start, on every replica alike."""
    digest = hashlib.blake2b(session.encode("utf-8", "surrogatepass"), key=key, digest_size=8).digest()
    return int.from_bytes(digest, "little")


class SessionTieKvAware(KvAware):
    """kv_aware whose ties (temperature 0) start at the session's keyed rank instead of a counter."""

    def __init__(self, key: bytes, **kwargs) -> None:
        super().__init__(**kwargs)
        self.key = key

    def choose(self, req, workers):
        if req.session and self.temperature <= 0 and workers:
            self._rot = session_rank(self.key, req.session) % len(workers) - 1  # _pick steps it by one
        return super().choose(req, workers)
