"""ARC, the Adaptive Replacement Cache (Megiddo & Modha), as an evictor of a pool's free cached blocks."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from agentkv.kv.eviction.base import Evictor


class ARC(Evictor):
    """Adaptive Replacement Cache (Megiddo & Modha) over the pool's cached blocks.

    T1 holds blocks seen once, T2 blocks reused; ghosts B1/B2 remember evicted hashes. Caching
    a hash found in B1 grows the target size `p` of T1 (recency pays), in B2 shrinks it
    (frequency pays). Victims come from T1's free blocks while T1 exceeds `p`, else from T2's.
    """

    name = "arc"

    def clear(self) -> None:
        n = self.pool.num_blocks
        self.c = n
        self.p = 0.0
        self._cls = [0] * n  # 1: T1, 2: T2, 0: not cached
        self.n1 = self.n2 = 0  # cached blocks in T1 / T2, free or in use
        self.t1: OrderedDict[int, None] = OrderedDict()  # free blocks of T1, LRU first
        self.t2: OrderedDict[int, None] = OrderedDict()
        self.b1: OrderedDict[int, None] = OrderedDict()  # ghost hashes
        self.b2: OrderedDict[int, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self.t1) + len(self.t2)

    def blocks(self) -> list[int]:
        return [*self.t1, *self.t2]

    def on_cached(
        self, blocks: list[int], start: int, parent: int | None, block_hashes: Sequence[int] = ()
    ) -> None:
        hash_of, cls, b1, b2 = self.pool.hash_of, self._cls, self.b1, self.b2
        for b in blocks:
            h = hash_of(b)
            if h in b1:
                self.p = min(self.c, self.p + max(len(b2) / len(b1), 1.0))
                del b1[h]
                cls[b] = 2
                self.n2 += 1
            elif h in b2:
                self.p = max(0.0, self.p - max(len(b1) / len(b2), 1.0))
                del b2[h]
                cls[b] = 2
                self.n2 += 1
            else:
                cls[b] = 1
                self.n1 += 1

    def add_many(self, blocks: list[int], session: object = None) -> None:
        cls, t1, t2 = self._cls, self.t1, self.t2
        for b in blocks:
            if cls[b] == 1:
                t1[b] = None
            else:
                t2[b] = None

    def remove_many(self, blocks: list[int]) -> None:
        cls, t1, t2 = self._cls, self.t1, self.t2
        for b in blocks:
            if cls[b] == 1:
                del t1[b]
                cls[b] = 2
                self.n1 -= 1
                self.n2 += 1
            else:
                del t2[b]

    def pop_victims(self, n: int) -> list[int]:
        hash_of, cls = self.pool.hash_of, self._cls
        out: list[int] = []
        for _ in range(n):
            if self.t1 and (self.n1 > self.p or not self.t2):
                b = self.t1.popitem(last=False)[0]
                self.n1 -= 1
                self.b1[hash_of(b)] = None
            else:
                b = self.t2.popitem(last=False)[0]
                self.n2 -= 1
                self.b2[hash_of(b)] = None
            cls[b] = 0
            out.append(b)
        while self.b1 and self.n1 + len(self.b1) > self.c:
            self.b1.popitem(last=False)
        while self.b2 and self.n1 + self.n2 + len(self.b1) + len(self.b2) > 2 * self.c:
            self.b2.popitem(last=False)
        return out

    def check(self) -> None:
        assert all(self._cls[b] == 1 for b in self.t1) and all(self._cls[b] == 2 for b in self.t2)
        assert self.n1 == self._cls.count(1) and self.n2 == self._cls.count(2)
