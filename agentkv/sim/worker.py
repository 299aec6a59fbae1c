"""One simulated engine as the router sees it (placement's `WorkerView`), and what it runs now."""

from __future__ import annotations

from collections.abc import Sequence

from agentkv.engine.engine import DecodeBurst, Engine, StepResult


class SimWorker:
    """One engine as the router sees it (the `WorkerView` protocol), plus what it is running now."""

    __slots__ = ("index", "engine", "pending", "burst", "version", "starting", "_cached")

    def __init__(self, index: int, engine: Engine):
        self.index = index
        self.engine = engine
        self.pending: StepResult | None = None  # the single step in flight
        self.burst: DecodeBurst | None = None  # or the decode burst in flight
        self.version = 0  # bumped when a burst is cut short, so its end event is ignored
        self.starting = False  # busy until a scheduled start event (after a cut burst)
        self._cached = engine.pool.cached

    def idle(self) -> bool:
        return self.pending is None and self.burst is None and not self.starting

    def active_requests(self) -> int:
        return self.engine.num_running + self.engine.num_waiting

    def active_blocks(self) -> int:
        pool = self.engine.pool
        return pool.num_blocks - pool.num_free_blocks

    def cached_prefix(self, block_hashes: Sequence[int]) -> tuple[int, int]:
        """Leading blocks cached on the GPU, then in lower tiers, found by bisection: exact when the
        cache holds prefixes whole, as LRU with tail-first freeing keeps it (what an index knows)."""
        gpu = _prefix_len(self._cached.__contains__, block_hashes, 0)
        lower = self.engine.pool.lower
        return gpu, (_prefix_len(lower.__contains__, block_hashes, gpu) - gpu if lower is not None else 0)


def _prefix_len(has, hashes: Sequence[int], start: int) -> int:
    """Index of the first hash at/after `start` that `has` lacks, by bisection (prefix-closed sets)."""
    n = len(hashes)
    if start >= n or not has(hashes[start]):
        return start
    if has(hashes[n - 1]):
        return n
    lo, hi = start, n - 1  # has(lo), not has(hi)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if has(hashes[mid]):
            lo = mid
        else:
            hi = mid
    return hi
