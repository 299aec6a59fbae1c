"""Belady's offline optimum: evict the free block whose next use lies farthest in the future.

It needs the whole access sequence up front (one list of block hashes per lookup, in the
order the pool will see `get_computed_blocks` calls), so it is a ceiling to measure online
policies against, not a policy to deploy. Ties (blocks next used by the same request) go to the
deeper block first, so a prefix never loses its head before its tail.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from heapq import heapify, heappop, heappush
from itertools import chain

import numpy as np

from agentkv.kv.policies import MASK32, Evictor

_DEPTH_BITS = 20


def next_use_keys(accesses: Sequence[Sequence[int]]) -> tuple[np.ndarray, np.ndarray]:
    """Per access (flattened) the key `next_request << 20 | position`, and each request's offset.

    `next_request` is the index of the next later request that uses the same hash, or
    `len(accesses)` when none does. Vectorised: one stable sort of all hashes.
    """
    lens = np.fromiter(map(len, accesses), dtype=np.int64, count=len(accesses))
    offsets = np.zeros(len(lens) + 1, dtype=np.int64)
    np.cumsum(lens, out=offsets[1:])
    total = int(offsets[-1])
    never = len(accesses)
    if total == 0:
        return np.zeros(0, dtype=np.int64), offsets
    h = np.fromiter(chain.from_iterable(accesses), dtype=np.uint64, count=total)
    req = np.repeat(np.arange(len(lens), dtype=np.int64), lens)
    order = np.argsort(h, kind="stable")  # equal hashes keep request order
    hs, rs = h[order], req[order]
    # runs of equal (hash, request); a run's next use is the next run's request if the hash matches
    starts = np.ones(total, dtype=bool)
    starts[1:] = (hs[1:] != hs[:-1]) | (rs[1:] != rs[:-1])
    run_idx = np.flatnonzero(starts)
    run_h, run_r = hs[run_idx], rs[run_idx]
    run_next = np.full(len(run_idx), never, dtype=np.int64)
    same = run_h[1:] == run_h[:-1]
    run_next[:-1][same] = run_r[1:][same]
    nxt = np.empty(total, dtype=np.int64)
    nxt[order] = run_next[np.cumsum(starts) - 1]
    pos = np.arange(total, dtype=np.int64) - np.repeat(offsets[:-1], lens)
    keys = (nxt << _DEPTH_BITS) | np.minimum(pos, (1 << _DEPTH_BITS) - 1)
    return keys, offsets


class Belady(Evictor):
    """Farthest next use first, from the known future `accesses` (each lookup's block hashes).

    `on_lookup` advances the clock and records, for each hash of that lookup, when it is used
    next; a block freed afterwards is keyed by it (hashes never looked up count as never used
    again). A max-heap with lazy deletion holds the free blocks.
    """

    name = "belady"

    def __init__(self, accesses: Iterable[Sequence[int]]) -> None:
        acc = accesses if isinstance(accesses, Sequence) else list(accesses)
        keys, offsets = next_use_keys(acc)
        self._keys = keys
        self._offsets = offsets.tolist()
        self._never = len(acc) << _DEPTH_BITS
        self._step = 0

    def clear(self) -> None:
        n = self.pool.num_blocks
        self._next: dict[int, int] = {}  # hash -> key of its next use after the current lookup
        self._cur: list[int | None] = [None] * n  # heap entry of a free block
        self._heap: list[int] = []
        self._n = 0

    def __len__(self) -> int:
        return self._n

    def blocks(self) -> list[int]:
        return [b for b, e in enumerate(self._cur) if e is not None]

    def on_lookup(self, block_hashes: Sequence[int]) -> None:
        i = self._step
        if i + 1 >= len(self._offsets):
            raise ValueError(f"belady: lookup #{i} is past the end of the given access sequence")
        lo, hi = self._offsets[i], self._offsets[i + 1]
        if hi - lo != len(block_hashes):
            raise ValueError(f"belady: lookup #{i} has {len(block_hashes)} hashes, the access "
                             f"sequence has {hi - lo}: the replay diverged from it")
        self._next.update(zip(block_hashes, self._keys[lo:hi].tolist(), strict=True))
        self._step = i + 1

    def add_many(self, blocks: list[int], session: object = None) -> None:
        get, bh, never, cur, heap = self._next.get, self.pool.block_hash, self._never, self._cur, self._heap
        for b in blocks:
            e = -((get(bh[b], never) << 32) | b)
            cur[b] = e
            heappush(heap, e)
        self._n += len(blocks)
        if len(heap) > 4 * len(cur) + 4096:
            self._heap = [e for e in heap if cur[(-e) & MASK32] == e]
            heapify(self._heap)

    def remove_many(self, blocks: list[int]) -> None:
        cur = self._cur
        for b in blocks:
            cur[b] = None
        self._n -= len(blocks)

    def pop_victims(self, n: int) -> list[int]:
        cur, heap, step = self._cur, self._heap, self._step
        out: list[int] = []
        while len(out) < n:
            e = heappop(heap)
            b = (-e) & MASK32
            if cur[b] != e:
                continue
            if (-e) >> (32 + _DEPTH_BITS) < step:  # its next use came and missed it: re-key
                e = -((self._next.get(self.pool.block_hash[b], self._never) << 32) | b)
                if (-e) >> (32 + _DEPTH_BITS) < step:
                    e = -((self._never << 32) | b)
                cur[b] = e
                heappush(heap, e)
                continue
            cur[b] = None
            out.append(b)
        self._n -= n
        return out

    def next_use(self, block: int) -> int | None:
        """The request index at which a free block is next used (len(accesses) = never), or None."""
        e = self._cur[block]
        return None if e is None else (-e) >> (32 + _DEPTH_BITS)

    def check(self) -> None:
        assert sum(e is not None for e in self._cur) == self._n
