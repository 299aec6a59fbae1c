"""LRU: vLLM v1's free-queue order (least recently freed first, a request's tail before its head)."""

from __future__ import annotations

import numpy as np

from agentkv.kv.eviction.base import ChunkQueue, StampedEvictor, stamp_loops


class LRU(StampedEvictor):
    """Least recently freed first, a request's tail before its head: vLLM v1's free-queue order.

    A lazy `ChunkQueue`, one chunk per free; a block's latest stamp is in `_stamp`, so a hit costs
    nothing and victims are filtered a window at a time.
    """

    name = "lru"

    def clear(self) -> None:
        self._reset_stamps()
        self._q = ChunkQueue()

    def blocks(self) -> list[int]:
        return self._q.live_blocks(self._live)

    def add_many(self, blocks: np.ndarray, session: object = None) -> None:
        self._q.push(blocks, self._stamps(blocks))
        self._n += len(blocks)
        if self._q.queued > 4 * len(self._stamp) + 4096:
            self._q.compact(self._live)

    def remove_many(self, blocks: np.ndarray) -> None:
        self._n -= len(blocks)  # the pool raises their ref counts, which retires their entries

    def pop_victims(self, n: int) -> np.ndarray:
        return self._evicted([self._q.pop(n, self._stamp, self.pool.ref)], n)

    def next_victims(self, n: int) -> np.ndarray:
        return self._q.peek(n, self._live)

    def room_before(self, blocks: np.ndarray, n: int) -> int:
        """The queue's order is its stamps' (each free stamps anew from a rising clock), so the first
        of `blocks` to go is their oldest stamp: count the live entries before it, nothing copied."""
        if n <= 0 or not len(blocks):
            return max(0, min(n, self._n))
        oldest = stamp_loops().min_stamp(blocks, self._stamp)
        return self._q.count_before(oldest, n, self._stamp, self.pool.ref)

    def check(self) -> None:
        assert len(self.blocks()) == self._n
