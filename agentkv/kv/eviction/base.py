"""The evictor interface and the stamp/chunk-queue bookkeeping the array evictors share.

An `Evictor` holds exactly the free blocks that still carry cached content. The pool adds a
request's cached blocks when it frees them (tail first), removes them when a lookup hits them
again, and asks for victims when no empty block is left. Hints (`on_cached`, `on_lookup`,
`session_*`) are no-ops here; ARC, the session policy and Belady use them. Blocks are plain
ints; per-block state is kept in lists or numpy arrays.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from agentkv.kv.pool import BlockPool

MASK32 = (1 << 32) - 1


class Evictor:
    """Orders free cached blocks and picks victims; one instance serves one pool (see `bind`)."""

    name = "evictor"
    arrays = False  # True: add/remove/pop take and give numpy int arrays instead of lists

    def bind(self, pool: BlockPool) -> None:
        """Attach to `pool` (its `ref`, `num_blocks` and `hash_of(block)` are readable) and start empty."""
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

    def next_victims(self, n: int):
        """The next `n` victims `pop_victims` would give, oldest first, without taking them; None
        where the policy cannot tell ahead (the caller then assumes any block may go)."""
        return None

    def room_before(self, blocks: np.ndarray, n: int) -> int | None:
        """How many of the next `n` victims go before the first of `blocks` (free blocks a waiting
        request needs) would; None where the policy cannot tell ahead (`next_victims`)."""
        order = self.next_victims(n)
        if order is None:
            return None
        mark = np.zeros(self.pool.num_blocks, bool)  # a mask, not np.isin: no sort of a long victim run
        mark[blocks] = True
        hits = mark[order]
        return int(hits.argmax()) if hits.any() else len(order)

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


_SL = None  # agentkv.kv.eviction.stamp_loops, imported at first use (numba loads it then)
_HYBRID_WARM = False  # the hybrid pool's loops loaded (`warm_hybrid_loops`)


def warm_hybrid_loops():
    """`stamp_loops()`, with the hybrid pool's loops each called once on empty input (numba loads
    each at its first call): a hybrid pool loads them when made, a dense one never."""
    global _HYBRID_WARM
    loops = stamp_loops()
    if _HYBRID_WARM:
        return loops
    i64, u64, no = np.zeros(0, np.int64), np.zeros(0, np.uint64), np.zeros(0, bool)
    keys, vals, shift = np.zeros(16, np.uint64), np.zeros(16, np.int64), np.uint64(60)
    loops.cut_free(i64, 0, 0, np.zeros(0, np.int32), no, i64, i64, 0, i64, 0)
    loops.chain_add(i64, i64, i64, i64, i64)
    loops.chain_drop(i64, u64, i64, i64, i64, u64, keys, vals, shift, 15, u64)
    loops.evict_first(
        i64, np.zeros(0, np.int16), no, u64, i64, i64, i64, u64, keys, vals, shift, 15, i64, 0, i64
    )
    loops.cache_run(i64, u64, keys, vals, shift, 15, u64, u64, no, i64, i64, i64, i64)
    loops.hinted_prefix(i64, 0, u64, 0, u64, i64, keys, vals, shift, 15, i64)
    loops.take_bytes(i64, i64, i64, i64, 0, i64)
    loops.take_ids(i64, 0, 0, i64, i64, np.zeros(0, np.int32), no, np.zeros(0, np.int16), i64, i64)
    loops.unpin(i64, np.zeros(0, np.int32), no, i64, i64, i64)
    _HYBRID_WARM = True
    return loops


def stamp_loops():
    """The stamped queues' compiled loops' module (a call, not an import statement, in hot paths).
    Its loops are called once on tiny tables here, so that numba's load (or compile) happens when a
    pool is made, not at a served request's first free."""
    global _SL
    if _SL is None:
        from agentkv.kv.eviction import stamp_loops as loops

        blocks, ref, out = np.arange(2, dtype=np.int64), np.ones(2, dtype=np.int32), np.empty(2, np.int64)
        loops.release(blocks, 1, ref, out, out[1:])
        loops.unheld(blocks, ref, out)
        loops.min_stamp(blocks, out)
        loops.live_before(blocks, out, out, ref, 1, 1)
        loops.pin(blocks[:0], ref)
        i64, u64, no = blocks[:0], np.zeros(0, np.uint64), np.zeros(0, bool)
        keys, vals, shift = np.zeros(16, np.uint64), np.zeros(16, np.int64), np.uint64(60)
        loops.cache_marks(i64, u64, keys, vals, shift, 15, i64, u64, no, no)
        loops.uncache_marks(i64, u64, no, no, keys, vals, shift, 15)
        _SL = loops
    return _SL


class ChunkQueue:
    """A FIFO of `(blocks, stamps)` numpy chunks with lazy deletion.

    An entry is live iff its stamp is still the block's latest and the block still free
    (`StampedEvictor._live`), so taking a block out of the middle costs nothing. An overloaded
    pool's queue is mostly stale entries; `pop` skips them in a compiled scan, the rarer readers
    (`peek`, `compact`, `live_blocks`) filter a numpy window at a time, a short window followed by
    one four times longer.
    """

    __slots__ = ("q", "queued")

    def __init__(self) -> None:
        self.q: deque[tuple[np.ndarray, np.ndarray]] = deque()
        self.queued = 0

    def push(self, blocks: np.ndarray, stamps: np.ndarray) -> None:
        self.q.append((blocks, stamps))
        self.queued += len(blocks)

    def pop(self, need: int, stamp: np.ndarray, ref: np.ndarray) -> np.ndarray:
        """Up to `need` live blocks, oldest first (fewer only when the queue runs dry), live by
        `StampedEvictor._live`'s test (`stamp`, `ref`): one compiled scan (`stamp_loops.take_live`)
        that reads a chunk only up to its last needed block, so a pop costs O(taken + stale)."""
        take = (_SL or stamp_loops()).take_live
        out = np.empty(need, dtype=np.int64)
        q, got = self.q, 0
        while got < need and q:
            bl, st = q[0]
            n, cut = take(bl, st, stamp, ref, need - got, out[got:])
            got += n
            if cut < len(bl):
                q[0] = (bl[cut:], st[cut:])
            else:
                q.popleft()
            self.queued -= cut
        return out[:got]

    def peek(self, need: int, live) -> np.ndarray:
        """The first `need` live blocks, oldest first, as `pop` would give them; the queue unchanged."""
        out: list[np.ndarray] = []
        grow = 1
        for bl, st in self.q:
            lo = 0
            while need > 0 and lo < len(bl):
                hi = min(len(bl), lo + (2 * need + 64) * grow)
                grow *= 4
                take = bl[lo:hi][live(bl[lo:hi], st[lo:hi])][:need]
                out.append(take)
                need -= len(take)
                lo = hi
            if need <= 0:
                break
        return np.concatenate(out) if out else np.zeros(0, dtype=np.int64)

    def count_before(self, bound: int, need: int, stamp: np.ndarray, ref: np.ndarray) -> int:
        """How many live entries (`pop`'s test) come before the first stamped `bound` or later, up to
        `need`: the victims `pop` gives before that block (stamps ascend along the queue)."""
        count = (_SL or stamp_loops()).live_before
        got = 0
        for bl, st in self.q:
            n, stop = count(bl, st, stamp, ref, bound, need - got)
            got += n
            if stop:
                break
        return got

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
