"""Approximate mode: predict what each worker caches from the router's own routing decisions.

For engines that publish no KV events (or requests hashed from raw text), the router assumes a
worker caches every block of each prompt it sent there, for `ttl` seconds since last use, and at
most `capacity` blocks per worker (least recently routed evicted first, as an LRU engine would).
The prediction lives in a per-tenant BlockIndex, so queries cost the same as in event mode.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Sequence

from agentkv.route.index import GPU, BlockIndex, Match


class ApproxIndex:
    """Per-tenant predicted block sets, kept to `capacity` blocks per worker and `ttl` seconds."""

    def __init__(
        self, capacity: int = 65_536, ttl: float = 300.0, clock: Callable[[], float] = time.monotonic
    ) -> None:
        if capacity < 1 or ttl <= 0:
            raise ValueError(f"capacity must be >= 1 and ttl > 0, got {capacity}, {ttl}")
        self.capacity, self.ttl, self.clock = capacity, ttl, clock
        self.indexes: dict[str, BlockIndex] = {}
        self._lru: dict[int, OrderedDict[tuple[str, int], float]] = {}  # worker -> (tenant, hash) -> expiry

    def record(self, worker: int, tenant: str, hashes: Sequence[int]) -> None:
        """`worker` was sent a prompt with these blocks: it will cache them (tail evicted first)."""
        if not hashes:
            return
        now = self.clock()
        self._expire(worker, now)
        idx = self.indexes.get(tenant)
        if idx is None:
            idx = self.indexes[tenant] = BlockIndex()
        idx.store(worker, hashes)
        lru = self._lru.setdefault(worker, OrderedDict())
        expiry = now + self.ttl
        for h in reversed(hashes):  # the head most recent: it is the part others share
            key = (tenant, h)
            lru[key] = expiry
            lru.move_to_end(key)
        evicted: dict[str, list[int]] = {}
        while len(lru) > self.capacity:
            (t, h), _ = lru.popitem(last=False)
            evicted.setdefault(t, []).append(h)
        for t, hs in evicted.items():
            self.indexes[t].remove(worker, hs)

    def _expire(self, worker: int, now: float) -> None:
        lru = self._lru.get(worker)
        if not lru:
            return
        gone: dict[str, list[int]] = {}
        while lru:
            key, expiry = next(iter(lru.items()))
            if expiry > now:
                break
            lru.popitem(last=False)
            gone.setdefault(key[0], []).append(key[1])
        for t, hs in gone.items():
            self.indexes[t].remove(worker, hs)

    def find_matches(self, tenant: str, hashes: Sequence[int]) -> dict[int, Match]:
        """Predicted cached prefix per worker for `tenant`'s request (expired entries dropped first)."""
        idx = self.indexes.get(tenant)
        if idx is None:
            return {}
        now = self.clock()
        for w in list(self._lru):
            self._expire(w, now)
        return idx.find_matches(hashes)

    def clear_worker(self, worker: int) -> int:
        """Forget a worker's predicted contents (it died or restarted)."""
        self._lru.pop(worker, None)
        return sum(idx.clear_worker(worker) for idx in self.indexes.values())

    def blocks(self, worker: int) -> int:
        return len(self._lru.get(worker, ()))

    def holds(self, worker: int, tenant: str, block_hash: int) -> bool:
        idx = self.indexes.get(tenant)
        return idx is not None and idx.holds(worker, block_hash, GPU)
