"""Belady's offline optimum: evict the free block whose next use lies farthest in the future.

It needs the whole access sequence up front (one list of block hashes per lookup, in the
order the pool will see `get_computed_blocks` calls), so it is a ceiling to measure online
policies against, not a policy to deploy. Ties (blocks next used by the same request) go to the
deeper block first, so a prefix never loses its head before its tail. (With prefix chains and
pinned running blocks it is the classic heuristic, not a proven optimum; the tests check it
beats every online policy on real traces.)
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from itertools import chain

import numpy as np

from agentkv.kv.eviction.base import Evictor

_DEPTH_BITS = 20


def next_use_keys(accesses: Sequence[Sequence[int]]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per access (flattened, in order): its key, the position of the hash's next use, and offsets.

    key = `next_request << 20 | position in its request`, where `next_request` is the index of
    the next later request that uses the same hash (`len(accesses)` when none does); the next
    use's flat position is -1 when there is none. Vectorised: one stable sort of all hashes.
    """
    lens = np.fromiter(map(len, accesses), dtype=np.int64, count=len(accesses))
    offsets = np.zeros(len(lens) + 1, dtype=np.int64)
    np.cumsum(lens, out=offsets[1:])
    total = int(offsets[-1])
    if total == 0:
        return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64), offsets
    h = np.fromiter(chain.from_iterable(accesses), dtype=np.uint64, count=total)
    req = np.repeat(np.arange(len(lens), dtype=np.int64), lens)
    order = np.argsort(h, kind="stable")  # equal hashes keep request order
    hs, rs = h[order], req[order]
    del h
    # runs of equal (hash, request); a run's next use is the next run's first access if the hash matches
    starts = np.ones(total, dtype=bool)
    starts[1:] = (hs[1:] != hs[:-1]) | (rs[1:] != rs[:-1])
    run_idx = np.flatnonzero(starts)
    same = np.zeros(len(run_idx), dtype=bool)
    same[:-1] = hs[run_idx[1:]] == hs[run_idx[:-1]]
    del hs
    run_next = np.full(len(run_idx), -1, dtype=np.int64)
    run_next[:-1][same[:-1]] = order[run_idx[1:]][same[:-1]]
    nxt_pos = np.empty(total, dtype=np.int64)
    nxt_pos[order] = run_next[np.cumsum(starts) - 1]
    nxt_req = np.where(nxt_pos >= 0, req[np.maximum(nxt_pos, 0)], len(accesses))
    pos = np.arange(total, dtype=np.int64) - np.repeat(offsets[:-1], lens)
    keys = (nxt_req << _DEPTH_BITS) | np.minimum(pos, (1 << _DEPTH_BITS) - 1)
    return keys, nxt_pos, offsets


class Belady(Evictor):
    """Farthest next use first, from the known future `accesses` (each lookup's block hashes).

    Every block remembers the flat position of its latest access (`_bpos`: set for the hits of a
    lookup and for the blocks a request caches), which gives its next use; a free block whose
    next use came and missed it (its prefix was gone) follows the chain of next uses. Evictor
    keys live in a numpy array (-1: not evictable); `pop_victims` takes the top ones with one
    `argpartition`: O(num_blocks) per allocation that must evict, no per-block Python work.
    """

    name = "belady"
    arrays = True

    def __init__(self, accesses: Iterable[Sequence[int]]) -> None:
        acc = accesses if isinstance(accesses, Sequence) else list(accesses)
        self._keys, self._nxt, offsets = next_use_keys(acc)
        self._offsets = offsets.tolist()
        self._never = len(acc) << _DEPTH_BITS
        self._step = 0
        self._lo: dict[int, int] = {}  # id(hash list) -> flat offset of its latest lookup

    def clear(self) -> None:
        n = self.pool.num_blocks
        self._bpos = np.full(n, -1, dtype=np.int64)  # flat position of each block's latest access
        self._key = np.full(n, -1, dtype=np.int64)
        self._n = 0

    def __len__(self) -> int:
        return self._n

    def blocks(self) -> list[int]:
        return np.flatnonzero(self._key >= 0).tolist()

    def on_lookup(self, block_hashes: Sequence[int], hits: Sequence[int]) -> None:
        i = self._step
        if i + 1 >= len(self._offsets):
            raise ValueError(f"belady: lookup #{i} is past the end of the given access sequence")
        lo, hi = self._offsets[i], self._offsets[i + 1]
        if hi - lo != len(block_hashes):
            raise ValueError(
                f"belady: lookup #{i} has {len(block_hashes)} hashes, the access "
                f"sequence has {hi - lo}: the replay diverged from it"
            )
        self._lo.pop(id(block_hashes), None)
        self._lo[id(block_hashes)] = lo
        if len(self._lo) > 4096:  # forget the oldest lookups
            del self._lo[next(iter(self._lo))]
        if len(hits):
            self._bpos[hits] = np.arange(lo, lo + len(hits))
        self._step = i + 1

    def on_cached(
        self, blocks: list[int], start: int, parent: int | None, block_hashes: Sequence[int] = ()
    ) -> None:
        lo = self._lo.get(id(block_hashes))
        if lo is None:
            raise ValueError("belady: blocks cached for a request that was never looked up")
        self._bpos[blocks] = np.arange(lo + start, lo + start + len(blocks))

    def _keys_of(self, blocks: np.ndarray) -> np.ndarray:
        p = self._bpos[blocks]
        return np.where(p >= 0, self._keys[p], self._never)

    def add_many(self, blocks: np.ndarray, session: object = None) -> None:
        self._key[blocks] = self._keys_of(blocks)
        self._n += len(blocks)

    def remove_many(self, blocks: np.ndarray) -> None:
        self._key[blocks] = -1
        self._n -= len(blocks)

    def pop_victims(self, n: int) -> np.ndarray:
        key, floor = self._key, self._step << _DEPTH_BITS
        stale = np.flatnonzero((key >= 0) & (key < floor))
        while len(stale):  # their next use came and missed them (prefix gone): the one after
            p = self._nxt[self._bpos[stale]]
            self._bpos[stale] = p
            key[stale] = np.where(p >= 0, self._keys[p], self._never)
            stale = stale[key[stale] < floor]
        top = np.argpartition(key, len(key) - n)[len(key) - n :] if n < len(key) else np.arange(len(key))
        top = top[np.argsort(-key[top], kind="stable")]
        key[top] = -1
        self._n -= n
        return top

    def next_use(self, block: int) -> int | None:
        """The request index at which a free block is next used (len(accesses) = never), or None."""
        k = int(self._key[block])
        return None if k < 0 else k >> _DEPTH_BITS

    def check(self) -> None:
        assert int((self._key >= 0).sum()) == self._n
