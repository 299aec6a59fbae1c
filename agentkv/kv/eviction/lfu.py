"""LFU: fewest reuses first, ties broken by LRU."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from agentkv.kv.eviction.base import Evictor


class LFU(Evictor):
    """Fewest reuses first (a reuse: a free cached block hit again); ties by LRU, tail first.

    O(1) LFU: one insertion-ordered bucket per frequency. A block's count restarts at 1 when it
    gets new content.
    """

    name = "lfu"

    def clear(self) -> None:
        n = self.pool.num_blocks
        self._freq = [1] * n
        self._where = [0] * n  # frequency bucket holding the block, 0 when not evictable
        self._buckets: dict[int, OrderedDict[int, None]] = {}
        self._n = 0

    def __len__(self) -> int:
        return self._n

    def blocks(self) -> list[int]:
        return [b for bk in self._buckets.values() for b in bk]

    def on_cached(
        self, blocks: list[int], start: int, parent: int | None, block_hashes: Sequence[int] = ()
    ) -> None:
        freq = self._freq
        for b in blocks:
            freq[b] = 1

    def add_many(self, blocks: list[int], session: object = None) -> None:
        freq, where, buckets = self._freq, self._where, self._buckets
        for b in blocks:
            f = freq[b]
            bk = buckets.get(f)
            if bk is None:
                bk = buckets[f] = OrderedDict()
            bk[b] = None
            where[b] = f
        self._n += len(blocks)

    def remove_many(self, blocks: list[int]) -> None:
        freq, where, buckets = self._freq, self._where, self._buckets
        for b in blocks:
            f = where[b]
            bk = buckets[f]
            del bk[b]
            if not bk:
                del buckets[f]
            where[b] = 0
            freq[b] = f + 1
        self._n -= len(blocks)

    def pop_victims(self, n: int) -> list[int]:
        out: list[int] = []
        while len(out) < n:
            f = min(self._buckets)
            bk = self._buckets[f]
            while bk and len(out) < n:
                b = bk.popitem(last=False)[0]
                self._where[b] = 0
                out.append(b)
            if not bk:
                del self._buckets[f]
        self._n -= n
        return out

    def check(self) -> None:
        assert sum(map(len, self._buckets.values())) == self._n
        for f, bk in self._buckets.items():
            assert bk and all(self._where[b] == f for b in bk)
