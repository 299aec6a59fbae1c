"""LRU over the hybrid pool's freed cached blocks, whose sizes differ by group: victims are taken
oldest first until enough bytes are free, exactly as one-at-a-time eviction would, by a compiled
scan of each chunk (`stamp_loops.take_bytes`; the same lazy stamped queue as
`eviction.base.ChunkQueue`)."""

from __future__ import annotations

from collections import deque

import numpy as np

from agentkv.kv.eviction.base import stamp_loops


def grown(a: np.ndarray, size: int, fill: int = 0) -> np.ndarray:
    """`a` copied into a longer array, the rest `fill` (None in an object array): the pool's
    per-block arrays grow as ids are taken. A zero fill comes from `np.zeros` (calloc), whose pages
    stay out of the resident set until written: a doubled array costs only the ids used."""
    if a.dtype == object:
        new = np.empty(size, dtype=object)
    elif fill == 0:
        new = np.zeros(size, dtype=a.dtype)
    else:
        new = np.full(size, fill, dtype=a.dtype)
    new[: len(a)] = a
    return new


class ByteLRU:
    """Least recently freed first. An entry is live while its stamp is the block's latest: a block
    referenced again (`removed`) has its stamp zeroed, so its old entries retire lazily."""

    def __init__(self, cost: np.ndarray) -> None:
        self.cost = cost  # bytes of each block id (the pool keeps it current)
        self._stamp = np.zeros(len(cost), dtype=np.int64)
        self._clock = 1
        self._q: deque[tuple[np.ndarray, np.ndarray]] = deque()
        self._queued = 0
        self.n = 0

    def __len__(self) -> int:
        return self.n

    def _live(self, blocks: np.ndarray, stamps: np.ndarray) -> np.ndarray:
        return self._stamp[blocks] == stamps

    def add(self, blocks: np.ndarray) -> None:
        """Blocks just freed, oldest first: they go to the tail."""
        k = len(blocks)
        stamps = np.arange(self._clock, self._clock + k, dtype=np.int64)
        self._clock += k
        self._stamp[blocks] = stamps
        self._q.append((blocks, stamps))
        self._queued += k
        self.n += k
        if self._queued > 4 * len(self._stamp) + 4096:  # as the dense LRU: bounded by the block ids,
            self._compact()  # not by the live entries (few while most cached blocks are in use)

    def grown(self, cost: np.ndarray) -> None:
        """The pool's per-block arrays grew (new ids: never freed)."""
        self.cost, self._stamp = cost, grown(self._stamp, len(cost))

    def removed(self, blocks: np.ndarray) -> None:
        """`blocks` left the LRU by being referenced again (a zero stamp matches no entry)."""
        self._stamp[blocks] = 0
        self.n -= len(blocks)

    def pop_bytes(self, need: int) -> tuple[np.ndarray, int]:
        """The oldest live blocks whose bytes first reach `need` (fewer only if the LRU runs dry), and
        their bytes: compiled scans (`stamp_loops.take_bytes`) that read a chunk only up to the last
        victim."""
        take_bytes = stamp_loops().take_bytes
        q, out, freed = self._q, [], 0
        while freed < need and q:
            bl, st = q[0]
            buf = np.empty(min(len(bl), 4096), dtype=np.int64)  # (a full one: the loop goes on)
            k, cut, got = take_bytes(bl, st, self._stamp, self.cost, need - freed, buf)
            freed += int(got)
            if cut < len(bl):
                q[0] = (bl[cut:], st[cut:])
            else:
                q.popleft()
            self._queued -= cut
            out.append(buf[:k])
        victims = (out[0] if len(out) == 1 else np.concatenate(out)) if out else np.zeros(0, dtype=np.int64)
        self.n -= len(victims)
        return victims, freed

    def _compact(self) -> None:
        """Drop the stale entries chunk by chunk, merging what is left into pieces of about 64K: no
        temporary the size of the whole queue (fresh pages cost more than the filtering here)."""
        q, bls, sts, m = deque(), [], [], 0
        for bl, st in self._q:
            ok = self._live(bl, st)
            bls.append(bl[ok])
            sts.append(st[ok])
            m += len(bls[-1])
            if m >= 1 << 16:
                q.append((np.concatenate(bls), np.concatenate(sts)))
                bls, sts, m = [], [], 0
        if m:
            q.append((np.concatenate(bls), np.concatenate(sts)))
        self._q = q
        self._queued = sum(len(c[0]) for c in q)

    def blocks(self) -> list[int]:
        """The live blocks, oldest first (for invariant checks)."""
        return [int(b) for bl, st in self._q for b in bl[self._live(bl, st)]]

    def clear(self) -> None:
        self._stamp[:] = 0
        self._q.clear()
        self._queued = self.n = 0
