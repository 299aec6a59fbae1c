"""Leaf-first radix LRU, as SGLang's radix cache evicts."""

from __future__ import annotations

from collections.abc import Sequence
from heapq import heapify, heappop, heappush

from agentkv.kv.eviction.base import MASK32, Evictor


class RadixLRU(Evictor):
    """Leaf-first LRU, as SGLang's radix cache: only blocks with no cached child are evictable.

    Never evicts a parent before its cached children, so cached content always forms whole
    prefixes (no orphaned chain tails). Leaves sit in a heap keyed by free order (tail first);
    a parent joins it when its last child goes. Should every free block have a cached child (a
    child pinned by a request that recomputed the parent), the oldest free block goes instead.
    """

    name = "radix"

    def clear(self) -> None:
        n = self.pool.num_blocks
        self._parent = [-1] * n
        self._pgen = [0] * n  # the parent's generation when linked: stale links are ignored
        self._gen = [g + 1 for g in getattr(self, "_gen", [0] * n)]
        self._nchild = [0] * n
        self._key: list[int | None] = [None] * n  # heap entry of a free block, None otherwise
        self._heap: list[int] = []
        self._clock = 0
        self._n = 0

    def __len__(self) -> int:
        return self._n

    def blocks(self) -> list[int]:
        return [b for b, k in enumerate(self._key) if k is not None]

    def on_cached(
        self, blocks: list[int], start: int, parent: int | None, block_hashes: Sequence[int] = ()
    ) -> None:
        par, pgen, gen, nchild = self._parent, self._pgen, self._gen, self._nchild
        prev = -1 if parent is None else parent
        for b in blocks:
            nchild[b] = 0
            par[b] = prev
            if prev >= 0:
                pgen[b] = gen[prev]
                nchild[prev] += 1
            prev = b

    def add_many(self, blocks: list[int], session: object = None) -> None:
        key, nchild, heap = self._key, self._nchild, self._heap
        c = self._clock
        for b in blocks:
            e = (c << 32) | b
            c += 1
            key[b] = e
            if nchild[b] == 0:
                heappush(heap, e)
        self._clock = c
        self._n += len(blocks)
        if len(heap) > 4 * len(key) + 4096:
            self._heap = [e for e in heap if key[e & MASK32] == e and nchild[e & MASK32] == 0]
            heapify(self._heap)

    def remove_many(self, blocks: list[int]) -> None:
        key = self._key
        for b in blocks:
            key[b] = None
        self._n -= len(blocks)

    def pop_victims(self, n: int) -> list[int]:
        key, nchild, heap, par, gen, pgen = (
            self._key,
            self._nchild,
            self._heap,
            self._parent,
            self._gen,
            self._pgen,
        )
        out: list[int] = []
        while len(out) < n:
            if heap:
                e = heappop(heap)
                b = e & MASK32
                if key[b] != e or nchild[b]:
                    continue
            else:  # no free leaf: fall back to the oldest free block
                b = min(k for k in key if k is not None) & MASK32
            key[b] = None
            gen[b] += 1
            out.append(b)
            p = par[b]
            if p >= 0 and gen[p] == pgen[b]:
                nchild[p] -= 1
                if nchild[p] == 0 and key[p] is not None:
                    heappush(heap, key[p])
        self._n -= n
        return out

    def check(self) -> None:
        assert sum(k is not None for k in self._key) == self._n
        live = {e for e in self._heap if self._key[e & MASK32] == e}
        for b, k in enumerate(self._key):
            if k is not None and self._nchild[b] == 0:
                assert k in live, f"free leaf {b} missing from the heap"
