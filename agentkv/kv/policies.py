"""Eviction policies over a pool's free cached blocks: LRU (vLLM's order), LFU, leaf-first radix LRU.

An `Evictor` holds exactly the free blocks that still carry cached content. The pool adds a
request's cached blocks when it frees them (tail first), removes them when a lookup hits them
again, and asks for victims when no empty block is left. Hints (`on_cached`, `on_lookup`,
`session_*`) are no-ops here; `ARC` (agentkv.kv.arc), `SessionAware`
(agentkv.kv.session_policy) and `Belady` (agentkv.kv.belady) use them. Blocks are plain ints; per-block state is kept in lists.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Iterable, Sequence
from heapq import heapify, heappop, heappush
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from agentkv.kv.pool import BlockPool

MASK32 = (1 << 32) - 1
POLICIES = ("lru", "lfu", "radix", "arc", "session", "belady")


class Evictor:
    """Orders free cached blocks and picks victims; one instance serves one pool (see `bind`)."""

    name = "evictor"
    arrays = False  # True: add/remove/pop take and give numpy int arrays instead of lists

    def bind(self, pool: BlockPool) -> None:
        """Attach to `pool` (its `ref`, `block_hash` and `num_blocks` are readable) and start empty."""
        self.pool = pool
        self.clear()

    def clear(self) -> None:
        raise NotImplementedError

    def __len__(self) -> int:
        raise NotImplementedError

    def blocks(self) -> list[int]:
        """The evictable blocks (any order); for invariant checks."""
        raise NotImplementedError

    def add_many(self, blocks: list[int], session: object = None) -> None:
        """Blocks just freed by a request of `session`, in the pool's preference order (tail first)."""
        raise NotImplementedError

    def remove_many(self, blocks: list[int]) -> None:
        """Free cached blocks hit again by a lookup: they leave the evictor (the pool pins them)."""
        raise NotImplementedError

    def pop_victims(self, n: int) -> list[int]:
        """Take `n` blocks out, best victim first (`n <= len(self)`); the pool drops their content."""
        raise NotImplementedError

    def check(self) -> None:
        """Assert internal consistency (tests)."""

    # single-block forms of the three verbs
    def add(self, block: int, session: object = None) -> None:
        self.add_many([block], session)

    def remove(self, block: int) -> None:
        self.remove_many([block])

    def victim(self) -> int:
        return self.pop_victims(1)[0]

    # hints: no-ops unless a policy uses them
    def on_cached(
        self, blocks: list[int], start: int, parent: int | None, block_hashes: Sequence[int] = ()
    ) -> None:
        """`blocks` got hashes: positions start.. of the request's `block_hashes`; `parent` precedes them."""

    def on_lookup(self, block_hashes: Sequence[int], hits: Sequence[int]) -> None:
        """A request looked up its prefix and found `hits` cached (once per `get_computed_blocks`)."""

    def session_paused(self, session: object, now: float, reason: str) -> None:
        """A session's request ended at `now`, waiting on a tool ("tool_use") or on its user."""

    def session_resumed(self, session: object, now: float) -> None:
        """A session's next request arrived at `now`."""

    def session_ended(self, session: object, now: float | None) -> None:
        """A session will send no more requests."""


class ChunkQueue:
    """A FIFO of `(blocks, stamps)` numpy chunks with lazy deletion, popped a window at a time.

    An entry is live iff `live(blocks, stamps)` says so (its stamp is still the block's latest
    and the block still free), so taking a block out of the middle costs nothing.
    """

    __slots__ = ("q", "queued")

    def __init__(self) -> None:
        self.q: deque[tuple[np.ndarray, np.ndarray]] = deque()
        self.queued = 0

    def push(self, blocks: np.ndarray, stamps: np.ndarray) -> None:
        self.q.append((blocks, stamps))
        self.queued += len(blocks)

    def pop(self, need: int, live) -> list[np.ndarray]:
        """Up to `need` live blocks, oldest first (fewer only when the queue runs dry)."""
        q = self.q
        out: list[np.ndarray] = []
        while need and q:  # a window of the oldest chunk, so a pop costs O(taken + stale)
            bl, st = q[0]
            w = min(len(bl), 2 * need + 64)
            ok = live(bl[:w], st[:w])
            idx = np.flatnonzero(ok)
            cut = int(idx[need - 1]) + 1 if len(idx) >= need else w
            take = bl[:cut][ok[:cut]]
            if cut < len(bl):
                q[0] = (bl[cut:], st[cut:])
            else:
                q.popleft()
            self.queued -= cut
            out.append(take)
            need -= len(take)
        return out

    def compact(self, live) -> None:
        """Drop the stale entries (one pass, in bulk)."""
        if not self.q:
            return
        bl = np.concatenate([c[0] for c in self.q])
        st = np.concatenate([c[1] for c in self.q])
        ok = live(bl, st)
        self.q = deque([(bl[ok], st[ok])])
        self.queued = int(ok.sum())

    def live_blocks(self, live) -> list[int]:
        return [int(b) for bl, st in self.q for b in bl[live(bl, st)]]


class StampedEvictor(Evictor):
    """Bookkeeping shared by the array evictors (LRU, session): each free stamps its blocks from a
    clock, queues hold (blocks, stamps) chunks, and an entry is live while its stamp is the block's
    latest and the block is unused; a hit costs nothing, stale entries are filtered when popped."""

    arrays = True

    def _reset_stamps(self) -> None:
        self._stamp = np.zeros(self.pool.num_blocks, dtype=np.int64)  # latest free stamp of each block
        self._clock = 1
        self._n = 0

    def __len__(self) -> int:
        return self._n

    def _live(self, blocks: np.ndarray, stamps: np.ndarray) -> np.ndarray:
        return (self._stamp[blocks] == stamps) & (self.pool.ref[blocks] == 0)

    def _stamps(self, blocks: np.ndarray) -> np.ndarray:
        """Fresh stamps for `blocks`, recorded first: their older queue entries retire."""
        k = len(blocks)
        stamps = np.arange(self._clock, self._clock + k, dtype=np.int64)
        self._clock += k
        self._stamp[blocks] = stamps
        return stamps

    def _evicted(self, out: list[np.ndarray], n: int) -> np.ndarray:
        """The `n` victims popped as chunks `out`, their stamps cleared."""
        victims = np.concatenate(out) if len(out) != 1 else out[0]
        self._stamp[victims] = 0
        self._n -= n
        return victims


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
        return self._evicted(self._q.pop(n, self._live), n)

    def check(self) -> None:
        assert len(self.blocks()) == self._n


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


def make_policy(name: str, *, accesses: Iterable[Sequence[int]] | None = None, **kwargs) -> Evictor:
    """A policy by name (one of POLICIES); "belady" needs the whole future `accesses` sequence."""
    if name == "belady":
        from agentkv.kv.belady import Belady

        if accesses is None:
            raise ValueError("the belady policy needs the access sequence (accesses=...)")
        return Belady(accesses)
    if name == "session":
        from agentkv.kv.session_policy import SessionAware

        return SessionAware(**kwargs)
    if name == "arc":
        from agentkv.kv.arc import ARC

        return ARC(**kwargs)
    classes = {"lru": LRU, "lfu": LFU, "radix": RadixLRU}
    if name not in classes:
        raise ValueError(f"unknown eviction policy {name!r} (expected one of: {', '.join(POLICIES)})")
    return classes[name](**kwargs)
